//! What the simulated clients know for certain, and the checks against it.
//!
//! A stream name goes through incarnations (create ... delete). The oracle follows the
//! acknowledged catalogue changes per name; while a change on a name is in flight, or since a
//! crash lost one's outcome, the name is unsettled and publishes and subscriptions started
//! then are not checked against an incarnation (their per-shard order still is). Every record
//! of an incarnation seen by a client (named by an `Ack`, or delivered) is kept per shard and
//! offset: a second sighting must match the first exactly (one record per offset), and after
//! a crash every acknowledged or delivered record of a surviving durable incarnation must be
//! in the log.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

/// One incarnation of a stream name.
#[derive(Debug)]
pub struct Incarnation {
    pub name: String,
    pub shards: u32,
    pub durable: bool,
    /// Per shard: what each offset holds, as far as any client saw.
    pub records: Vec<BTreeMap<u64, Seen>>,
}

/// A record a client saw at an offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub key: Bytes,
    pub payload: Bytes,
    /// An `Ack` named this offset for this record (it must survive any crash).
    pub acked: bool,
    /// A subscriber received it (durable: it must survive any crash too).
    pub delivered: bool,
}

/// How a client saw a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sighting {
    /// An `Ack` named its offset.
    Acked,
    /// A subscriber received it.
    Delivered,
}

/// A catalogue change a client sent and has no answer for yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Create,
    Delete,
}

/// One change in flight on a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    pub id: u64,
    pub change: Change,
    /// No other change on the name was in flight at any time during this one's life: core 0
    /// ran it alone, so its answer says what the name is now.
    pub alone: bool,
}

/// What the clients know of one name.
#[derive(Debug, Default)]
pub struct NameState {
    /// The current incarnation, as of the last change known to have run alone.
    pub current: Option<u64>,
    /// Changes ran side by side (core 0 ordered them in a way no client saw): `current` is
    /// unknown until a change that runs alone, or a describe, says what the name is.
    pub unknown: bool,
    /// Changes in flight (sent, not answered).
    pub in_flight: Vec<InFlight>,
    /// Bumped whenever a change is sent or answered: a snapshot taken before is stale.
    pub epoch: u64,
    /// A crash lost the outcome of these changes; resolved from the recovered catalogue.
    pub lost: Vec<Change>,
}

impl NameState {
    fn settled(&self) -> bool {
        self.in_flight.is_empty() && self.lost.is_empty() && !self.unknown
    }
}

/// A snapshot of a name taken when a request was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub incarnation: u64,
    pub epoch: u64,
}

#[derive(Debug, Default)]
pub struct Oracle {
    next_incarnation: u64,
    next_change: u64,
    pub incarnations: HashMap<u64, Incarnation>,
    pub names: BTreeMap<String, NameState>,
    /// Bumped at every change sent or answered, any name (for list checks).
    pub global_epoch: u64,
}

impl Oracle {
    fn name(&mut self, name: &str) -> &mut NameState {
        self.names.entry(name.to_owned()).or_default()
    }

    /// The incarnation a request sent now is certain to reach, if the name is settled.
    pub fn snapshot(&mut self, name: &str) -> Option<Snapshot> {
        let state = self.name(name);
        if !state.settled() {
            return None;
        }
        Some(Snapshot {
            incarnation: state.current?,
            epoch: state.epoch,
        })
    }

    /// Whether nothing changed on the name since `snapshot` (the request's answer is then
    /// certainly about that incarnation).
    pub fn still(&self, name: &str, snapshot: Option<Snapshot>) -> Option<u64> {
        let snapshot = snapshot?;
        let state = self.names.get(name)?;
        (state.epoch == snapshot.epoch
            && state.current == Some(snapshot.incarnation)
            && state.settled())
        .then_some(snapshot.incarnation)
    }

    /// Whether every name is settled (a list answered now is certain).
    pub fn all_settled(&self) -> bool {
        self.names.values().all(NameState::settled)
    }

    /// A change is sent; returns its id for [`Oracle::end`].
    pub fn begin(&mut self, name: &str, change: Change) -> u64 {
        self.global_epoch += 1;
        let id = self.next_change;
        self.next_change += 1;
        let state = self.name(name);
        let alone = state.in_flight.is_empty();
        for other in &mut state.in_flight {
            other.alone = false;
        }
        state.in_flight.push(InFlight { id, change, alone });
        state.epoch += 1;
        id
    }

    /// A change was answered (successfully or not). Returns whether it ran alone (its outcome
    /// then says what the name is); otherwise the name becomes unknown.
    pub fn end(&mut self, name: &str, id: u64) -> bool {
        self.global_epoch += 1;
        let state = self.name(name);
        let position = state
            .in_flight
            .iter()
            .position(|c| c.id == id)
            .expect("an answered change was in flight");
        let change = state.in_flight.remove(position);
        state.epoch += 1;
        if !change.alone {
            state.unknown = true;
        }
        change.alone
    }

    /// What a change that ran alone found: the name holds a stream (of unknown incarnation,
    /// if it was unknown) or not.
    pub fn found(&mut self, name: &str, exists: bool) {
        let state = self.name(name);
        if exists {
            assert!(
                state.unknown || state.current.is_some(),
                "{name} exists though it was acknowledged deleted"
            );
        } else {
            assert!(
                state.unknown || state.current.is_none(),
                "{name} does not exist though it was acknowledged created"
            );
            state.current = None;
            state.unknown = false;
        }
    }

    /// The name's epoch if no change on it is in flight (a describe sent now reads a state
    /// no change is altering).
    pub fn quiet_epoch(&mut self, name: &str) -> Option<u64> {
        let state = self.name(name);
        (state.in_flight.is_empty() && state.lost.is_empty()).then_some(state.epoch)
    }

    /// A describe sent at `epoch` (see [`Oracle::quiet_epoch`]) found the stream (`Some`) or
    /// not: if nothing changed since, that is what an unknown name is.
    pub fn described(&mut self, name: &str, epoch: Option<u64>, found: Option<(u32, bool)>) {
        let state = self.name(name);
        if !state.unknown || epoch != Some(state.epoch) {
            return;
        }
        match found {
            Some((shards, durable)) => {
                self.created(name, shards, durable);
            }
            None => self.found(name, false),
        }
    }

    pub fn created(&mut self, name: &str, shards: u32, durable: bool) -> u64 {
        let id = self.next_incarnation;
        self.next_incarnation += 1;
        self.incarnations.insert(
            id,
            Incarnation {
                name: name.to_owned(),
                shards,
                durable,
                records: (0..shards).map(|_| BTreeMap::new()).collect(),
            },
        );
        let state = self.name(name);
        state.current = Some(id);
        state.unknown = false;
        id
    }

    pub fn deleted(&mut self, name: &str) {
        let state = self.name(name);
        state.current = None;
        state.unknown = false;
    }

    /// A client saw `key`/`payload` at `offset` of `shard` of `incarnation`, through an ack
    /// or a delivery: it must be the record any earlier sighting saw there.
    pub fn saw(
        &mut self,
        incarnation: u64,
        shard: u32,
        offset: u64,
        (key, payload): (&Bytes, &Bytes),
        how: Sighting,
    ) {
        let (acked, delivered) = match how {
            Sighting::Acked => (true, false),
            Sighting::Delivered => (false, true),
        };
        let inc = self
            .incarnations
            .get_mut(&incarnation)
            .expect("a known incarnation");
        let records = &mut inc.records[shard as usize];
        match records.get_mut(&offset) {
            Some(seen) => {
                assert!(
                    seen.key == *key && seen.payload == *payload,
                    "two records at offset {offset} of shard {shard} of {:?}: {:?}/{:?} and \
                     {:?}/{:?}",
                    inc.name,
                    seen.key,
                    seen.payload,
                    key,
                    payload
                );
                seen.acked |= acked;
                seen.delivered |= delivered;
            }
            None => {
                records.insert(
                    offset,
                    Seen {
                        key: key.clone(),
                        payload: payload.clone(),
                        acked,
                        delivered,
                    },
                );
            }
        }
    }

    /// The highest acknowledged offset of a shard, if any.
    pub fn last_acked(&self, incarnation: u64, shard: u32) -> Option<u64> {
        self.incarnations[&incarnation].records[shard as usize]
            .iter()
            .rev()
            .find(|(_, seen)| seen.acked)
            .map(|(offset, _)| *offset)
    }

    /// A crash: in-memory streams are gone, durable ones survive; changes in flight lost
    /// their outcome.
    pub fn crash(&mut self) {
        self.global_epoch += 1;
        for state in self.names.values_mut() {
            state.epoch += 1;
            state
                .lost
                .extend(state.in_flight.drain(..).map(|c| c.change));
            if std::mem::take(&mut state.unknown) {
                // Resolved like a lost change: the catalogue says what survived.
                state.lost.push(Change::Create);
            }
            if let Some(current) = state.current
                && !self.incarnations[&current].durable
            {
                state.current = None;
            }
        }
    }

    /// After the restart: resolves names whose changes were lost from the recovered catalogue
    /// (`catalogued`: name -> shard count). Returns the names whose presence contradicts
    /// what was acknowledged.
    pub fn resolve(&mut self, catalogued: &BTreeMap<String, u32>) -> Vec<String> {
        let mut contradictions = Vec::new();
        let names: Vec<String> = self
            .names
            .keys()
            .chain(catalogued.keys())
            .cloned()
            .collect();
        for name in names {
            let present = catalogued.get(&name).copied();
            let state = self.names.entry(name.clone()).or_default();
            let lost = std::mem::take(&mut state.lost);
            if lost.is_empty() {
                let expected = state.current.map(|id| {
                    let inc = &self.incarnations[&id];
                    (inc.shards, inc.durable)
                });
                match (expected, present) {
                    (None, None) => {}
                    (Some((shards, true)), Some(count)) if shards == count => {}
                    _ => contradictions.push(name.clone()),
                }
                continue;
            }
            // The outcome of the lost changes decides; an old durable incarnation is kept
            // (with its records to check) when every lost change was a delete that did not
            // happen.
            let keep_old = lost.iter().all(|c| *c == Change::Delete)
                && state.current.is_some_and(|id| {
                    self.incarnations[&id].durable && Some(self.incarnations[&id].shards) == present
                });
            match present {
                Some(_) if keep_old => {}
                Some(shards) => {
                    let id = self.next_incarnation;
                    self.next_incarnation += 1;
                    self.incarnations.insert(
                        id,
                        Incarnation {
                            name: name.clone(),
                            shards,
                            durable: true,
                            records: (0..shards).map(|_| BTreeMap::new()).collect(),
                        },
                    );
                    state.current = Some(id);
                }
                None => state.current = None,
            }
        }
        contradictions
    }
}
