//! Datagrams that are not QUIC, and mutilated copies of a real QUIC Initial, sent with a plain
//! UDP socket to the shared port and to each core's own port. The broker owes them nothing; it
//! must keep serving, and (RFC 9000 8.1) never answer an unvalidated address with more than
//! three times what it received from it.

use std::net::SocketAddr;
use std::time::Duration;

use rand::Rng as _;
use tokio::net::UdpSocket;

use super::{Ctx, ensure};
use crate::raw::{STEP, client_endpoint};

/// How long a socket listens for answers after its last datagram.
const LISTEN: Duration = Duration::from_millis(1500);

/// A UDP socket of the target's address family, counting what it sends and receives.
struct Probe {
    socket: UdpSocket,
    sent: u64,
    datagrams: u64,
    received: u64,
    answers: u64,
}

impl Probe {
    async fn new(ctx: &Ctx) -> Result<Probe, String> {
        let bind = if ctx.target().quic_addr.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        };
        let socket = UdpSocket::bind(bind)
            .await
            .map_err(|error| format!("UDP bind: {error}"))?;
        Ok(Probe {
            socket,
            sent: 0,
            datagrams: 0,
            received: 0,
            answers: 0,
        })
    }

    async fn send(&mut self, to: SocketAddr, datagram: &[u8]) -> Result<(), String> {
        match self.socket.send_to(datagram, to).await {
            Ok(len) => {
                self.sent += len as u64;
                self.datagrams += 1;
                Ok(())
            }
            // A datagram over the path's limit is refused locally: nothing was sent.
            Err(error) if error.raw_os_error() == Some(90) => Ok(()),
            Err(error) => Err(format!("UDP send of {} bytes: {error}", datagram.len())),
        }
    }

    /// Counts what comes back until `LISTEN` passes with nothing new.
    async fn drain(&mut self) {
        let mut buffer = vec![0u8; 65_536];
        while let Ok(Ok((len, _))) =
            tokio::time::timeout(LISTEN, self.socket.recv_from(&mut buffer)).await
        {
            self.received += len as u64;
            self.answers += 1;
        }
    }
}

fn ports(ctx: &Ctx) -> Vec<(String, SocketAddr)> {
    let mut out = vec![("the shared port".to_owned(), ctx.target().quic_addr)];
    for (index, addr) in ctx.core_addrs().iter().enumerate() {
        out.push((format!("core {index}'s port"), *addr));
    }
    out
}

/// Random datagrams (sizes up to 1500, a few of 65,000 bytes), long-header lookalikes with
/// unknown versions and short-header lookalikes, to every port.
pub(crate) async fn garbage_datagrams(ctx: &mut Ctx) -> Result<(), String> {
    const RANDOM: usize = 120;
    const HUGE: usize = 3;
    const LOOKALIKES: usize = 20;
    let mut lines = Vec::new();
    for (what, addr) in ports(ctx) {
        let mut probe = Probe::new(ctx).await?;
        for _ in 0..RANDOM {
            let len = ctx.rng.random_range(1..=1500);
            let mut datagram = vec![0u8; len];
            ctx.rng.fill(&mut datagram[..]);
            probe.send(addr, &datagram).await?;
        }
        for _ in 0..HUGE {
            let mut datagram = vec![0u8; 65_000];
            ctx.rng.fill(&mut datagram[..]);
            probe.send(addr, &datagram).await?;
        }
        for index in 0..LOOKALIKES {
            let len = ctx.rng.random_range(21..=1400);
            let mut datagram = vec![0u8; len.max(1200 * (index % 2))];
            ctx.rng.fill(&mut datagram[..]);
            if index % 2 == 0 {
                // Short header: fixed bit set, a random connection id no connection has.
                datagram[0] = 0x40 | (datagram[0] & 0x3f);
            } else {
                // Long header, Initial, an unknown version: version negotiation territory.
                datagram[0] = 0xc0 | (datagram[0] & 0x0f);
                datagram[1..5].copy_from_slice(&[0x1a, 0x2a, 0x3a, 0x4a]);
                datagram[5] = 8;
            }
            probe.send(addr, &datagram).await?;
        }
        probe.drain().await;
        lines.push(format!(
            "{what}: {} datagrams ({} bytes) sent, {} answers ({} bytes)",
            probe.datagrams, probe.sent, probe.answers, probe.received
        ));
        ensure(probe.received <= 3 * probe.sent, || {
            format!(
                "{what}: {} bytes answered to {} bytes of garbage (over 3x)",
                probe.received, probe.sent
            )
        })?;
    }
    for line in lines {
        ctx.note(line);
    }
    Ok(())
}

/// The first datagram of a real QUIC handshake (an Initial carrying a ClientHello for
/// `felix/1`), caught by a local socket posing as the broker.
async fn capture_initial(ctx: &Ctx) -> Result<Vec<u8>, String> {
    let bind = if ctx.target().quic_addr.is_ipv6() {
        "[::1]:0"
    } else {
        "127.0.0.1:0"
    };
    let sink = UdpSocket::bind(bind)
        .await
        .map_err(|error| format!("UDP bind: {error}"))?;
    let sink_addr = sink
        .local_addr()
        .map_err(|error| format!("UDP address: {error}"))?;
    let endpoint = client_endpoint(ctx.target())?;
    let connect = s2n_quic::client::Connect::new(sink_addr)
        .with_server_name(ctx.target().server_name.as_str());
    let mut buffer = vec![0u8; 65_536];
    let captured = tokio::time::timeout(STEP, async {
        tokio::select! {
            attempt = endpoint.connect(connect) => {
                Err(format!("the capture's handshake ended first: {:?}", attempt.err()))
            }
            received = sink.recv_from(&mut buffer) => match received {
                Ok((len, _)) => Ok(buffer[..len].to_vec()),
                Err(error) => Err(format!("UDP receive: {error}")),
            },
        }
    })
    .await
    .map_err(|_| "no Initial captured".to_owned())??;
    // Long header, type Initial, version 1.
    ensure(
        captured.len() >= 1200 && captured[0] & 0xf0 == 0xc0 && captured[1..5] == [0, 0, 0, 1],
        || {
            format!(
                "the captured datagram is not a v1 Initial: {:02x?}",
                &captured[..8.min(captured.len())]
            )
        },
    )?;
    Ok(captured)
}

/// Byte offsets of an Initial's header fields: (dcid length, scid length, token length).
fn header_offsets(initial: &[u8]) -> Option<(usize, usize, usize)> {
    let dcid_len_at = 5;
    let dcid_len = usize::from(*initial.get(dcid_len_at)?);
    let scid_len_at = dcid_len_at + 1 + dcid_len;
    let scid_len = usize::from(*initial.get(scid_len_at)?);
    let token_len_at = scid_len_at + 1 + scid_len;
    (token_len_at < initial.len()).then_some((dcid_len_at, scid_len_at, token_len_at))
}

/// Mutilated copies of a real Initial: truncated, bit-flipped, with impossible header fields,
/// padded after a cut, doubled; and a genuine Initial (a connection the broker starts and then
/// abandons). Sent to every port.
pub(crate) async fn mutilated_initials(ctx: &mut Ctx) -> Result<(), String> {
    const FLIPS: usize = 24;
    let initial = capture_initial(ctx).await?;
    let (dcid_len_at, scid_len_at, token_len_at) =
        header_offsets(&initial).ok_or("the Initial's header does not parse")?;
    let mut variants: Vec<(String, Vec<u8>)> = Vec::new();
    for cut in [
        1,
        4,
        5,
        6,
        7,
        20,
        50,
        100,
        300,
        600,
        1000,
        1199,
        initial.len() - 1,
    ] {
        if cut < initial.len() {
            variants.push((format!("cut to {cut} bytes"), initial[..cut].to_vec()));
        }
    }
    for _ in 0..FLIPS {
        let mut flipped = initial.clone();
        let at = ctx.rng.random_range(0..flipped.len());
        let bit = ctx.rng.random_range(0..8);
        flipped[at] ^= 1 << bit;
        variants.push((format!("bit {bit} of byte {at} flipped"), flipped));
    }
    let edit = |at: usize, value: u8, what: &str| {
        let mut edited = initial.clone();
        edited[at] = value;
        (what.to_owned(), edited)
    };
    variants.push(edit(dcid_len_at, 21, "a 21-byte destination id length"));
    variants.push(edit(dcid_len_at, 255, "a 255-byte destination id length"));
    variants.push(edit(scid_len_at, 255, "a 255-byte source id length"));
    variants.push(edit(token_len_at, 0xbf, "a huge token length"));
    variants.push(edit(1, 0x0a, "version 0x0a000001"));
    let mut reserved = initial.clone();
    reserved[1..5].copy_from_slice(&[0x0a, 0x0a, 0x0a, 0x0a]);
    variants.push(("a reserved version (negotiation)".to_owned(), reserved));
    let mut padded = initial[..200].to_vec();
    padded.resize(initial.len(), 0);
    variants.push(("cut to 200 bytes, zero-padded".to_owned(), padded));
    let mut doubled = initial.clone();
    doubled.extend_from_slice(&initial);
    variants.push(("two copies in one datagram".to_owned(), doubled));
    let count = variants.len();
    let mut lines = Vec::new();
    for (what, addr) in ports(ctx) {
        let mut probe = Probe::new(ctx).await?;
        for (_, datagram) in &variants {
            probe.send(addr, datagram).await?;
        }
        probe.drain().await;
        lines.push(format!(
            "{what}: {count} mutilated Initials ({} bytes) sent, {} answers ({} bytes)",
            probe.sent, probe.answers, probe.received
        ));
        ensure(probe.received <= 3 * probe.sent, || {
            format!(
                "{what}: {} bytes answered to {} bytes from an unvalidated address (over the \
                 3x of RFC 9000 8.1)",
                probe.received, probe.sent
            )
        })?;
        // A fresh Initial (a connection id this endpoint has not seen: a copy of one it is
        // handshaking already is ignored from another address) alone, from an address of its
        // own: the broker starts a handshake it then abandons, answering at most three times
        // the datagram, retransmissions included.
        let fresh = capture_initial(ctx).await?;
        let mut replay = Probe::new(ctx).await?;
        replay.send(addr, &fresh).await?;
        replay.drain().await;
        lines.push(format!(
            "{what}: a genuine Initial ({} bytes) got {} answers ({} bytes)",
            replay.sent, replay.answers, replay.received
        ));
        ensure(replay.answers > 0, || {
            format!("{what}: no answer to a genuine Initial (the capture is not what it seems)")
        })?;
        ensure(replay.received <= 3 * replay.sent, || {
            format!(
                "{what}: {} bytes answered to a {}-byte Initial from an unvalidated address \
                 (over the 3x of RFC 9000 8.1)",
                replay.received, replay.sent
            )
        })?;
    }
    for line in lines {
        ctx.note(line);
    }
    Ok(())
}
