//! The peer transport over real QUIC on loopback (`felix_cluster::transport`): frames arrive
//! complete, in order per pair and lane and with the sender's member id; a member whose certificate
//! another CA issued, or a member not in the peer list, delivers nothing; a restarted peer is
//! redialled; an oversized frame closes only its connection.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_cluster::pki::{ClusterCa, NodeIdentity};
use felix_cluster::transport::{FRAME_BYTES_MAX, Inbound, Lane, PeerTransport, TransportConfig};
use tokio::sync::mpsc;

/// Generous deadline for anything a test waits for (loaded 2-core machine, parallel tests).
const DEADLINE: Duration = Duration::from_secs(30);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().expect("address")
}

fn config(
    ca: &ClusterCa,
    id: u64,
    bind: SocketAddr,
    peers: &BTreeMap<u64, SocketAddr>,
) -> TransportConfig {
    identity_config(ca.issue_node(id, &[]).expect("cert"), ca, bind, peers)
}

fn identity_config(
    identity: NodeIdentity,
    ca: &ClusterCa,
    bind: SocketAddr,
    peers: &BTreeMap<u64, SocketAddr>,
) -> TransportConfig {
    let id = identity.node_id;
    TransportConfig {
        node_id: id,
        bind,
        peers: peers
            .iter()
            .filter(|(peer, _)| **peer != id)
            .map(|(peer, addr)| (*peer, *addr))
            .collect(),
        identity,
        ca_pem: ca.cert_pem.clone(),
        // The broker's default FELIX_MTU_UPPER_BOUND.
        max_mtu: 4096,
    }
}

/// Free UDP ports on loopback, asked of the OS (the transports bind them right after).
fn addresses(ids: &[u64]) -> BTreeMap<u64, SocketAddr> {
    ids.iter()
        .map(|id| {
            let socket = std::net::UdpSocket::bind(loopback()).expect("bind");
            (*id, socket.local_addr().expect("addr"))
        })
        .collect()
}

async fn next(frames: &mut mpsc::Receiver<Inbound>) -> Inbound {
    tokio::time::timeout(DEADLINE, frames.recv())
        .await
        .expect("a frame within the deadline")
        .expect("the transport is running")
}

/// Sends `frame` to `to` until one arrives at `frames` (the first may be dropped while the
/// connection comes up); returns what arrived.
async fn send_until_delivered(
    from: &PeerTransport,
    to: u64,
    frames: &mut mpsc::Receiver<Inbound>,
    frame: &'static [u8],
) -> Inbound {
    let deadline = Instant::now() + DEADLINE;
    loop {
        from.send(to, Lane::Replication, Bytes::from_static(frame));
        if let Ok(Some(inbound)) =
            tokio::time::timeout(Duration::from_millis(200), frames.recv()).await
        {
            return inbound;
        }
        assert!(Instant::now() < deadline, "no frame delivered to {to}");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn frames_arrive_in_order_from_the_right_member() {
    let ca = ClusterCa::generate("test CA").expect("ca");
    let addrs = addresses(&[1, 2, 3]);
    let mut nodes = BTreeMap::new();
    for id in [1, 2, 3] {
        let (transport, frames) =
            PeerTransport::start(config(&ca, id, addrs[&id], &addrs)).expect("start");
        nodes.insert(id, (transport, frames));
    }
    // Connections come up first: one probe per pair until it arrives.
    for from in [1u64, 2, 3] {
        for to in [1u64, 2, 3] {
            if from == to {
                continue;
            }
            let (sender, receiver) = {
                let mut split = nodes.iter_mut();
                let mut sender = None;
                let mut receiver = None;
                for (id, node) in &mut split {
                    if *id == from {
                        sender = Some(&node.0);
                    } else if *id == to {
                        receiver = Some(&mut node.1);
                    }
                }
                (sender.expect("sender"), receiver.expect("receiver"))
            };
            let probe = send_until_delivered(sender, to, receiver, b"probe").await;
            assert_eq!(probe.from, from);
            // Drain any further probes.
            while let Ok(extra) = receiver.try_recv() {
                assert_eq!(&extra.frame[..], b"probe");
            }
        }
    }
    const FRAMES: u64 = 1_000;
    for (id, (transport, _)) in &nodes {
        for to in [1u64, 2, 3].into_iter().filter(|to| to != id) {
            for n in 0..FRAMES {
                // Sizes from 0 to several KiB, so frames split across QUIC packets.
                // Every third frame on the forward lane: each lane keeps its own order.
                let lane = if n.is_multiple_of(3) {
                    Lane::Forward
                } else {
                    Lane::Replication
                };
                let mut frame = format!("{id}->{to}:{n}:").into_bytes();
                frame.resize(frame.len() + usize::try_from(n % 7).unwrap() * 997, b'x');
                assert!(transport.send(to, lane, Bytes::from(frame)), "queued");
            }
        }
    }
    for (id, (_, frames)) in &mut nodes {
        // Per sender and lane: the next frame number expected.
        let mut next_from: BTreeMap<(u64, bool), u64> = BTreeMap::new();
        for _ in 0..2 * FRAMES {
            let inbound = next(frames).await;
            let text = String::from_utf8_lossy(&inbound.frame).to_string();
            let header: Vec<&str> = text.splitn(3, ':').collect();
            assert_eq!(
                header[0],
                format!("{}->{id}", inbound.from),
                "from the sender"
            );
            let n: u64 = header[1].parse().expect("a number");
            let forward = n.is_multiple_of(3);
            let expected = next_from
                .entry((inbound.from, forward))
                .or_insert(if forward { 0 } else { 1 });
            assert_eq!(
                n, *expected,
                "in order from {} (forward lane: {forward})",
                inbound.from
            );
            *expected += if forward {
                3
            } else if *expected % 3 == 1 {
                1
            } else {
                2
            };
            assert_eq!(
                inbound.frame.len(),
                format!("{}->{id}:{n}:", inbound.from).len()
                    + usize::try_from(n % 7).unwrap() * 997
            );
        }
    }
    for (transport, _) in nodes.values() {
        let stats = transport.stats();
        assert!(
            stats.sent >= 2 * FRAMES && stats.received >= 2 * FRAMES,
            "{stats:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn members_from_another_ca_or_outside_the_list_deliver_nothing() {
    let ca = ClusterCa::generate("cluster CA").expect("ca");
    let other_ca = ClusterCa::generate("someone else's CA").expect("ca");
    let addrs = addresses(&[1, 2, 3, 9]);
    // Member 1 knows members 2 and 3 only.
    let mut listed = addrs.clone();
    listed.remove(&9);
    let (good, mut good_frames) =
        PeerTransport::start(config(&ca, 1, addrs[&1], &listed)).expect("start");
    // Member 2 with a certificate of another CA (trusting that CA itself).
    let impostor_config = identity_config(
        other_ca.issue_node(2, &[]).expect("cert"),
        &other_ca,
        addrs[&2],
        &addrs,
    );
    let (impostor, _impostor_frames) = PeerTransport::start(impostor_config).expect("start");
    // Member 9: a certificate of the right CA, but not in member 1's peer list.
    let (stranger, _stranger_frames) =
        PeerTransport::start(config(&ca, 9, addrs[&9], &addrs)).expect("start");
    // Member 3: a good one.
    let (three, _three_frames) =
        PeerTransport::start(config(&ca, 3, addrs[&3], &addrs)).expect("start");
    let deadline = Instant::now() + DEADLINE;
    let mut from_three = false;
    while !(from_three && impostor.stats().connect_failures > 0 && good.stats().refused > 0) {
        assert!(
            Instant::now() < deadline,
            "impostor {:?}, member 1 {:?}, member 3 heard: {from_three}",
            impostor.stats(),
            good.stats()
        );
        impostor.send(1, Lane::Replication, Bytes::from_static(b"forged"));
        stranger.send(1, Lane::Replication, Bytes::from_static(b"stranger"));
        three.send(1, Lane::Replication, Bytes::from_static(b"good"));
        if let Ok(Some(inbound)) =
            tokio::time::timeout(Duration::from_millis(100), good_frames.recv()).await
        {
            assert_eq!(
                (inbound.from, &inbound.frame[..]),
                (3, &b"good"[..]),
                "member 1 accepted only member 3's frames"
            );
            from_three = true;
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_member_whose_certificate_the_server_refuses_never_counts_as_connected() {
    // It trusts the cluster CA (so it accepts the server) but holds a certificate of another
    // CA: its TLS 1.3 handshake completes on its side before the server refuses it, and only
    // the missing accept byte tells it.
    let ca = ClusterCa::generate("cluster CA").expect("ca");
    let other_ca = ClusterCa::generate("someone else's CA").expect("ca");
    let addrs = addresses(&[1, 2]);
    let (one, mut one_frames) =
        PeerTransport::start(config(&ca, 1, addrs[&1], &addrs)).expect("start");
    let mut refused = identity_config(
        other_ca.issue_node(2, &[]).expect("cert"),
        &ca,
        addrs[&2],
        &addrs,
    );
    refused.ca_pem = ca.cert_pem.clone();
    let (two, _two_frames) = PeerTransport::start(refused).expect("start");
    let deadline = Instant::now() + DEADLINE;
    while two.stats().connect_failures < 3 {
        assert!(Instant::now() < deadline, "{:?}", two.stats());
        two.send(1, Lane::Replication, Bytes::from_static(b"refused"));
        assert!(
            two.connected_peers().is_empty(),
            "a refused member is never connected"
        );
        assert!(
            one_frames.try_recv().is_err(),
            "nothing from a refused member"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(two.stats().connects, 0, "{:?}", two.stats());
    drop(one);
}

#[tokio::test(flavor = "current_thread")]
async fn a_restarted_peer_is_redialled() {
    let ca = ClusterCa::generate("test CA").expect("ca");
    let addrs = addresses(&[1, 2]);
    let (one, _one_frames) =
        PeerTransport::start(config(&ca, 1, addrs[&1], &addrs)).expect("start");
    let (two, mut two_frames) =
        PeerTransport::start(config(&ca, 2, addrs[&2], &addrs)).expect("start");
    assert_eq!(
        send_until_delivered(&one, 2, &mut two_frames, b"before")
            .await
            .from,
        1
    );
    drop(two);
    drop(two_frames);
    // The same member again on the same port (the old socket may take a moment to go).
    let deadline = Instant::now() + DEADLINE;
    let (_two, mut two_frames) = loop {
        match PeerTransport::start(config(&ca, 2, addrs[&2], &addrs)) {
            Ok(started) => break started,
            Err(error) => {
                assert!(Instant::now() < deadline, "cannot rebind: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let after = send_until_delivered(&one, 2, &mut two_frames, b"after").await;
    assert_eq!((after.from, &after.frame[..]), (1, &b"after"[..]));
    assert!(one.stats().connects >= 2, "{:?}", one.stats());
}

#[tokio::test(flavor = "current_thread")]
async fn an_oversized_frame_closes_only_its_connection() {
    let ca = ClusterCa::generate("test CA").expect("ca");
    let addrs = addresses(&[1, 2]);
    let (one, mut one_frames) =
        PeerTransport::start(config(&ca, 1, addrs[&1], &addrs)).expect("start");
    let (two, _two_frames) =
        PeerTransport::start(config(&ca, 2, addrs[&2], &addrs)).expect("start");
    assert_eq!(
        send_until_delivered(&two, 1, &mut one_frames, b"hello")
            .await
            .from,
        2
    );
    // The sender refuses to queue a frame the receiver would refuse.
    assert!(!two.send(
        1,
        Lane::Replication,
        Bytes::from(vec![0u8; FRAME_BYTES_MAX + 1])
    ));
    // A raw member-2 client announcing an oversized frame.
    let identity = ca.issue_node(2, &[]).expect("cert");
    let tls = s2n_quic::provider::tls::default::Client::builder()
        .with_application_protocols([felix_cluster::transport::ALPN])
        .and_then(|b| b.with_empty_trust_store())
        .and_then(|b| b.with_certificate(ca.cert_pem.as_str()))
        .and_then(|b| b.with_client_identity(identity.cert_pem.as_str(), identity.key_pem.as_str()))
        .and_then(|b| b.build())
        .expect("tls");
    let client = s2n_quic::Client::builder()
        .with_tls(tls)
        .expect("tls")
        .with_io(loopback())
        .expect("io")
        .start()
        .expect("client");
    let connect = s2n_quic::client::Connect::new(addrs[&1]).with_server_name("felix-node-1");
    let mut connection = client.connect(connect).await.expect("connects");
    let (mut answers, mut stream) = connection
        .open_bidirectional_stream()
        .await
        .expect("stream")
        .split();
    stream
        .send(Bytes::copy_from_slice(&2u64.to_be_bytes()))
        .await
        .expect("hello sent");
    let accepted = tokio::time::timeout(DEADLINE, answers.receive())
        .await
        .expect("an answer")
        .expect("the stream is open")
        .expect("a byte");
    assert_eq!(&accepted[..], &[1u8], "the hello of member 2 is accepted");
    let oversized = u32::try_from(FRAME_BYTES_MAX + 1).unwrap().to_be_bytes();
    stream
        .send(Bytes::copy_from_slice(&oversized))
        .await
        .expect("header sent");
    let closed = tokio::time::timeout(DEADLINE, async {
        loop {
            if connection.ping().is_err() || stream.send(Bytes::from_static(b"x")).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection is closed");
    assert!(one.stats().refused >= 1, "{:?}", one.stats());
    // Member 2's own transport still delivers.
    let later = send_until_delivered(&two, 1, &mut one_frames, b"later").await;
    assert_eq!(later.from, 2);
}
