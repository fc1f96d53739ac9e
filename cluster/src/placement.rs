//! Where each stream's shards go: which brokers hold a copy (the replicas), which of them
//! leads, and which data-plane core of the leader owns the shard.
//!
//! Placement is a pure function of the stream's definition and the members registered when
//! the stream is created, computed while the control plane applies `CreateStream`, so every
//! broker computes the same answer from the same log. It spreads **each stream's** leaders
//! over the members (shard `i` of a stream is led by the member at `(start + i) mod n`, where
//! `start` rotates with the number of streams created before), not only the cluster's: one
//! stream dominating a deployment still gets every broker's write capacity. Replicas follow
//! the leader around the ring of members.

use serde::{Deserialize, Serialize};

/// One shard's place in the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPlacement {
    /// The members holding a copy, the leader first.
    pub replicas: Vec<u64>,
    /// The member that leads the shard (takes its publishes, orders its records).
    pub leader: u64,
    /// The data-plane core of the leader that owns the shard.
    pub core: u16,
}

/// A member as placement sees it: its id and how many data-plane cores it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub id: u64,
    pub cores: u16,
}

/// Places `shards` shards with `replicas` copies each over `members` (sorted by id, at least
/// `replicas` of them), starting the leader rotation at `start`.
///
/// Each member leads `shards / n` or one more of this stream's shards; the shards a member
/// leads are spread over its cores in turn.
#[must_use]
pub fn place(members: &[Seat], shards: u32, replicas: usize, start: u64) -> Vec<ShardPlacement> {
    let n = members.len();
    assert!(
        n > 0 && replicas > 0 && replicas <= n,
        "placement needs enough members"
    );
    let mut led_so_far = vec![0u32; n];
    (0..shards)
        .map(|shard| {
            let first = usize::try_from((start + u64::from(shard)) % n as u64)
                .expect("an index below the member count");
            let replicas: Vec<u64> = (0..replicas).map(|k| members[(first + k) % n].id).collect();
            let seat = members[first];
            let core = u16::try_from(led_so_far[first] % u32::from(seat.cores.max(1)))
                .expect("a core below the core count");
            led_so_far[first] += 1;
            ShardPlacement {
                leader: seat.id,
                replicas,
                core,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seats(n: u64, cores: u16) -> Vec<Seat> {
        (1..=n).map(|id| Seat { id, cores }).collect()
    }

    #[test]
    fn each_streams_leaders_are_spread_evenly() {
        // Proves the per-stream spread the reference lacked (one stream's 12 leaders 1/1/10).
        for start in 0..5 {
            let placed = place(&seats(3, 2), 12, 3, start);
            for id in 1..=3 {
                let led = placed.iter().filter(|p| p.leader == id).count();
                assert_eq!(led, 4, "member {id} leads a third at start {start}");
            }
            for p in &placed {
                assert_eq!(p.replicas[0], p.leader);
                let mut distinct = p.replicas.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(distinct.len(), 3, "three distinct copies");
                assert!(p.core < 2);
            }
        }
    }

    #[test]
    fn a_members_shards_are_spread_over_its_cores() {
        let placed = place(&seats(3, 2), 12, 1, 0);
        let cores: Vec<u16> = placed
            .iter()
            .filter(|p| p.leader == 1)
            .map(|p| p.core)
            .collect();
        assert_eq!(cores, vec![0, 1, 0, 1]);
    }

    #[test]
    fn uneven_counts_differ_by_at_most_one() {
        let placed = place(&seats(3, 1), 7, 2, 1);
        let mut counts = [0; 3];
        for p in &placed {
            counts[usize::try_from(p.leader - 1).unwrap()] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(max - min <= 1, "{counts:?}");
    }
}
