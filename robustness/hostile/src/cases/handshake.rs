//! The handshake: frames before `Hello`, version ranges, feature bits, names, tokens, a second
//! `Hello`, requests pipelined behind it, and connections that never complete it.

use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_wire::{
    AckMode, ErrorCode, FEATURE_TOKEN, FEATURES_KNOWN, Frame, Hello, ShardSelection, StartPosition,
};

use super::framing::expect_refused_handshake;
use super::{Ctx, ensure};
use crate::frames;
use crate::raw::{Closed, Next, RawConn, STEP, client_endpoint_offering, describe};

fn hello_frame(min_version: u16, max_version: u16, features: u64, name: &str) -> Frame {
    Frame::Hello(Hello {
        min_version,
        max_version,
        features,
        client_name: name.to_owned(),
        token: None,
    })
}

/// Any frame but `Hello` as the first frame of a connection: refused, closed with 5.
pub(crate) async fn frames_before_hello(ctx: &mut Ctx) -> Result<(), String> {
    let firsts = [
        Frame::ListStreams { request_id: 1 },
        frames::create(2, "hostile-before-hello", 1),
        frames::publish(3, "hostile-health", &[("k", "v")], AckMode::Acked),
        frames::subscribe(
            4,
            "hostile-health",
            ShardSelection::All,
            StartPosition::Latest,
        ),
        frames::server_frames()
            .into_iter()
            .next()
            .ok_or("no server frame")?,
    ];
    let mut message = None;
    for frame in firsts {
        let name = frame.frame_type().name();
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream.send_frame(&frame).await?;
        let error = expect_refused_handshake(&mut conn, &mut stream, ErrorCode::ProtocolViolation)
            .await
            .map_err(|error| format!("{name} before Hello: {error}"))?;
        message.get_or_insert(error.message);
    }
    ctx.undocumented(format!(
        "a frame before Hello gets Error protocol_violation (request id 0, message {:?}) on the \
         first stream before the connection is closed with 5",
        message.unwrap_or_default()
    ));
    Ok(())
}

/// `Hello` version ranges that exclude 1 (min > max among them): unsupported_version, close 2;
/// a range around 1 is accepted.
pub(crate) async fn hello_versions_without_1(ctx: &mut Ctx) -> Result<(), String> {
    let refused = [(2, 2), (0, 0), (2, 1), (5, 1), (u16::MAX, 0), (2, u16::MAX)];
    for (min, max) in refused {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream
            .send_frame(&hello_frame(min, max, 0, "felix-hostile"))
            .await?;
        expect_refused_handshake(&mut conn, &mut stream, ErrorCode::UnsupportedVersion)
            .await
            .map_err(|error| format!("versions {min}..={max}: {error}"))?;
    }
    let mut conn = ctx.connect().await?;
    let mut stream = conn.stream().await?;
    stream
        .send_frame(&hello_frame(0, u16::MAX, 0, "felix-hostile"))
        .await?;
    let version = stream
        .expect_frame("HelloOk", |frame| match frame {
            Frame::HelloOk(ok) => Some(ok.version),
            _ => None,
        })
        .await
        .map_err(|error| format!("versions 0..=65535: {error}"))?;
    ensure(version == 1, || {
        format!("versions 0..=65535: the broker chose version {version}")
    })
}

/// Unknown feature bits are accepted and not echoed; client names at the edges of their limit.
pub(crate) async fn hello_edge_cases(ctx: &mut Ctx) -> Result<(), String> {
    let name_255 = format!("{}x", "\u{e9}".repeat(127));
    let accepted = [
        (
            "every unknown feature bit",
            !FEATURES_KNOWN,
            "felix-hostile".to_owned(),
        ),
        ("feature bit 63", 1u64 << 63, "felix-hostile".to_owned()),
        ("an empty client name", 0, String::new()),
        ("a 255-byte client name", 0, name_255),
    ];
    let cores = ctx.core_addrs().len();
    for (what, features, name) in accepted {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream
            .send_frame(&hello_frame(1, 1, features, &name))
            .await?;
        let ok = stream
            .expect_frame("HelloOk", |frame| match frame {
                Frame::HelloOk(ok) => Some(ok),
                _ => None,
            })
            .await
            .map_err(|error| format!("a Hello with {what}: {error}"))?;
        ensure(ok.features == 0, || {
            format!(
                "a Hello with {what}: HelloOk.features is {:#x}, not 0 (bits it did not use)",
                ok.features
            )
        })?;
        ensure(ok.version == 1 && ok.core_ports.len() == cores, || {
            format!("a Hello with {what}: unexpected HelloOk {ok:?}")
        })?;
        // The connection works.
        stream
            .send_frame(&Frame::ListStreams { request_id: 1 })
            .await?;
        stream
            .expect_frame("StreamList", |frame| {
                matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
            })
            .await
            .map_err(|error| format!("after a Hello with {what}: {error}"))?;
    }
    Ok(())
}

/// A token that is malformed or unknown: refused with unauthenticated, close 60.
pub(crate) async fn hello_with_a_bogus_token(ctx: &mut Ctx) -> Result<(), String> {
    let tokens = [
        "not-a-token".to_owned(),
        format!("felix_{}_{}", "0123456789abcdef", "ab".repeat(32)),
        String::new(),
    ];
    for token in tokens {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream
            .send_frame(&Frame::Hello(Hello {
                min_version: 1,
                max_version: 1,
                features: FEATURE_TOKEN,
                client_name: "felix-hostile".to_owned(),
                token: Some(Bytes::from(token.clone())),
            }))
            .await?;
        expect_refused_handshake(&mut conn, &mut stream, ErrorCode::Unauthenticated)
            .await
            .map_err(|error| format!("token {token:?}: {error}"))?;
    }
    Ok(())
}

/// A second `Hello`, on the hello stream and on a new stream.
pub(crate) async fn second_hello(ctx: &mut Ctx) -> Result<(), String> {
    let mut session = ctx.session().await?;
    let hello = frames::hello("felix-hostile-again");
    session.hello_stream.send_frame(&hello).await?;
    session
        .hello_stream
        .expect_stream_error(ErrorCode::ProtocolViolation)
        .await
        .map_err(|error| format!("a second Hello on the hello stream: {error}"))?;
    let mut stream = session.stream().await?;
    stream.send_frame(&hello).await?;
    stream
        .expect_stream_error(ErrorCode::ProtocolViolation)
        .await
        .map_err(|error| format!("a Hello on a new stream: {error}"))?;
    let mut stream = session.stream().await?;
    stream
        .send_frame(&Frame::ListStreams { request_id: 1 })
        .await?;
    stream
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
        })
        .await
        .map_err(|error| format!("the connection after a second Hello: {error}"))
}

/// Requests sent before `HelloOk` arrived (which the client must not do): behind the Hello on
/// the hello stream, and on a second stream.
pub(crate) async fn request_pipelined_after_hello(ctx: &mut Ctx) -> Result<(), String> {
    let mut conn = ctx.connect().await?;
    let mut hello_stream = conn.stream().await?;
    let mut bytes = frames::encode(&frames::hello("felix-hostile")).to_vec();
    bytes.extend_from_slice(&frames::encode(&Frame::ListStreams { request_id: 5 }));
    hello_stream.send(Bytes::from(bytes)).await?;
    let mut second = conn.stream().await?;
    second
        .send_frame(&Frame::ListStreams { request_id: 6 })
        .await?;
    hello_stream
        .expect_frame("HelloOk", |frame| {
            matches!(frame, Frame::HelloOk(_)).then_some(())
        })
        .await?;
    hello_stream
        .expect_frame("StreamList 5 behind the HelloOk", |frame| {
            matches!(frame, Frame::StreamList { request_id: 5, .. }).then_some(())
        })
        .await?;
    second
        .expect_frame("StreamList 6 on the second stream", |frame| {
            matches!(frame, Frame::StreamList { request_id: 6, .. }).then_some(())
        })
        .await?;
    Ok(())
}

/// Connections that never get a Hello answered: nothing at all, a Hello dribbled too slowly,
/// a Hello on the second stream (the first stays empty). Each is closed with 5 once
/// FELIX_HELLO_TIMEOUT_MS has passed (and not before).
pub(crate) async fn no_hello_in_time(ctx: &mut Ctx) -> Result<(), String> {
    let Some(timeout) = ctx.target().limits.hello_timeout else {
        ctx.skip("FELIX_HELLO_TIMEOUT_MS unknown");
        return Ok(());
    };
    let target = ctx.target().clone();
    let addr = target.quic_addr;
    let wait = timeout + STEP;
    let silent = async {
        let mut conn = RawConn::open(&target, addr).await?;
        let opened = Instant::now();
        conn.expect_closed(ErrorCode::ProtocolViolation, wait)
            .await
            .map_err(|error| format!("a silent connection: {error}"))?;
        Ok::<Duration, String>(opened.elapsed())
    };
    let dribbled = async {
        let mut conn = RawConn::open(&target, addr).await?;
        let opened = Instant::now();
        let mut stream = conn.stream().await?;
        let hello = frames::encode(&frames::hello("felix-hostile-slow"));
        // The whole Hello would take twice the timeout.
        let pause = (timeout * 2) / u32::try_from(hello.len()).unwrap_or(u32::MAX);
        for index in 0..hello.len() {
            if stream.send(hello.slice(index..=index)).await.is_err() {
                break;
            }
            match stream.next(pause).await {
                Next::Silent => {}
                Next::Closed(_) | Next::Fin => break,
                other => {
                    return Err(format!(
                        "a dribbled Hello: unexpected {} after {index} bytes",
                        describe(&other)
                    ));
                }
            }
        }
        conn.expect_closed(ErrorCode::ProtocolViolation, wait)
            .await
            .map_err(|error| format!("a dribbled Hello: {error}"))?;
        Ok(opened.elapsed())
    };
    let second_stream = async {
        let mut conn = RawConn::open(&target, addr).await?;
        let opened = Instant::now();
        let _first = conn.stream().await?;
        let mut second = conn.stream().await?;
        second.send_frame(&frames::hello("felix-hostile")).await?;
        match second.next(wait).await {
            Next::Closed(closed) if closed_with(&closed, ErrorCode::ProtocolViolation) => {}
            other => {
                return Err(format!(
                    "a Hello on the second stream: expected the connection closed with 5, got {}",
                    describe(&other)
                ));
            }
        }
        Ok(opened.elapsed())
    };
    let (silent, dribbled, second_stream) = tokio::join!(silent, dribbled, second_stream);
    let floor = timeout.mul_f64(0.9);
    for (what, elapsed) in [
        ("a silent connection", silent?),
        ("a dribbled Hello", dribbled?),
        ("a Hello on the second stream", second_stream?),
    ] {
        ensure(elapsed >= floor, || {
            format!("{what} was closed after {elapsed:?}, before the hello timeout {timeout:?}")
        })?;
        ctx.note(format!("{what}: closed with 5 after {elapsed:.2?}"));
    }
    ctx.undocumented(
        "a Hello on any stream but the connection's first is never read: the connection is \
         closed with 5 at the hello timeout",
    );
    Ok(())
}

fn closed_with(closed: &Closed, code: ErrorCode) -> bool {
    closed.is_peer_code(code)
}

/// A QUIC handshake that does not offer ALPN `felix/1` (another protocol, several others, no
/// ALPN extension): refused by a TLS alert during the handshake.
pub(crate) async fn wrong_alpn(ctx: &mut Ctx) -> Result<(), String> {
    let offers: [&[&[u8]]; 3] = [&[b"h3"], &[b"felix/2", b"other"], &[]];
    for protocols in offers {
        let shown: Vec<String> = protocols
            .iter()
            .map(|protocol| String::from_utf8_lossy(protocol).into_owned())
            .collect();
        let endpoint = client_endpoint_offering(ctx.target(), protocols)?;
        let connect = s2n_quic::client::Connect::new(ctx.target().quic_addr)
            .with_server_name(ctx.target().server_name.as_str());
        let started = Instant::now();
        match tokio::time::timeout(STEP, endpoint.connect(connect)).await {
            Ok(Err(s2n_quic::connection::Error::Transport { code, .. }))
                if (0x100..0x200).contains(&code.as_u64()) =>
            {
                ctx.note(format!(
                    "ALPN {shown:?}: TLS alert {:#x} after {:.0?}",
                    code.as_u64(),
                    started.elapsed()
                ));
            }
            Ok(Err(error)) => {
                return Err(format!(
                    "ALPN {shown:?}: refused otherwise than by a TLS alert: {error}"
                ));
            }
            Ok(Ok(_)) => return Err(format!("ALPN {shown:?}: the handshake completed")),
            Err(_) => return Err(format!("ALPN {shown:?}: no answer within {STEP:?}")),
        }
    }
    Ok(())
}
