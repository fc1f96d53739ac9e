//! Bytes that are not valid frames: random bytes, frames cut short, unknown types, bad flags,
//! trailing or missing bytes, and every length and count field of every client frame set past
//! its limit. The expected code of random bytes comes from the reference decoder
//! (`felix_wire::Decoder` with the broker's announced limits): the broker must agree with it.

use bytes::{Bytes, BytesMut};
use felix_wire::{Decoder, ErrorCode, FEATURE_TOKEN, Frame, FrameType, Limits, WireError};
use rand::Rng as _;

use super::{Ctx, Session, ensure};
use crate::frames::{self, Body, header};
use crate::raw::{Next, RawConn, RawStream, STEP, describe};

/// The message the broker gives a frame cut short by FIN (`WireError::Malformed` of the
/// pseudo-frame "frame").
const TRUNCATED: &str = "the stream ended inside a frame";
/// The largest FELIX_HELLO_MAX_BYTES the broker accepts (docs/configuration.md): a Hello header
/// announcing more is frame_too_large under every setting.
const HELLO_MAX_BYTES_CEILING: u32 = 1 << 20;
/// The smallest FELIX_HELLO_MAX_BYTES: a Hello body within it is judged the same under every
/// setting.
const HELLO_MAX_BYTES_FLOOR: u32 = 1 << 10;

/// What the broker must answer to bytes followed by FIN, per the reference decoder.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// The first frame is undecodable: this error.
    Error(WireError),
    /// The bytes end inside a frame: malformed once FIN arrives.
    Truncated,
    /// The bytes start with a valid frame (not what a random case wants).
    Valid,
}

fn verdict(decoder: &Decoder, bytes: &[u8]) -> Verdict {
    let mut buffer = BytesMut::from(bytes);
    match decoder.decode(&mut buffer) {
        Ok(Some(_)) => Verdict::Valid,
        Ok(None) => Verdict::Truncated,
        Err(error) => Verdict::Error(error),
    }
}

fn random_bytes(ctx: &mut Ctx, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    ctx.rng.fill(&mut bytes[..]);
    bytes
}

/// Sends `bytes` then FIN on a new stream of `session`. A send error is not fatal: the broker
/// may stop reading once the header decided the error (the answer is still there to read).
async fn send_on_new_stream(session: &mut Session, bytes: Bytes) -> Result<RawStream, String> {
    let mut stream = session.stream().await?;
    let _ = stream.send_fin(bytes).await;
    Ok(stream)
}

/// Expects the documented answer to an undecodable frame, with the decoder's own message.
async fn expect_decode_error(stream: &mut RawStream, expected: &WireError) -> Result<(), String> {
    let error = stream.expect_stream_error(expected.code()).await?;
    ensure(error.message == expected.to_string(), || {
        format!(
            "the Error message {:?} is not the decoder's {:?}",
            error.message,
            expected.to_string()
        )
    })
}

async fn expect_truncated(stream: &mut RawStream) -> Result<(), String> {
    let error = stream.expect_stream_error(ErrorCode::Malformed).await?;
    ensure(error.message.contains(TRUNCATED), || {
        format!(
            "unexpected message for a truncated frame: {:?}",
            error.message
        )
    })
}

/// Random bytes (seeded, several sizes) on new request streams, with and without a valid
/// frame header in front: the broker answers exactly what the reference decoder decides.
pub(crate) async fn random_bytes_on_request_streams(ctx: &mut Ctx) -> Result<(), String> {
    const SIZES: [usize; 11] = [1, 5, 6, 7, 13, 64, 600, 1500, 20_000, 200_000, 700_000];
    let limits = ctx.limits();
    let decoder = Decoder::new(limits);
    let mut session = ctx.session().await?;
    let mut codes = std::collections::BTreeMap::<&'static str, u32>::new();
    for size in SIZES {
        for with_header in [false, true] {
            // Random bytes that happen to decode are drawn again (bounded: they are rare).
            let mut attempt = 0;
            let (bytes, expected) = loop {
                attempt += 1;
                let bytes = if with_header {
                    let frame_type = FrameType::ALL[ctx.rng.random_range(0..FrameType::ALL.len())];
                    let body = random_bytes(ctx, size);
                    let len = u32::try_from(size).unwrap_or(u32::MAX);
                    Body::new().bytes(&body).frame_as(frame_type as u8, len, 0)
                } else {
                    Bytes::from(random_bytes(ctx, size))
                };
                let expected = verdict(&decoder, &bytes);
                if expected != Verdict::Valid || attempt >= 32 {
                    break (bytes, expected);
                }
            };
            let label = format!(
                "{size} random bytes{}",
                if with_header {
                    " after a valid header"
                } else {
                    ""
                }
            );
            let mut stream = send_on_new_stream(&mut session, bytes).await?;
            let checked = match &expected {
                Verdict::Error(error) => {
                    *codes.entry(error.code().name()).or_default() += 1;
                    expect_decode_error(&mut stream, error).await
                }
                Verdict::Truncated => {
                    *codes.entry("truncated").or_default() += 1;
                    expect_truncated(&mut stream).await
                }
                Verdict::Valid => {
                    ctx.note(format!("{label}: drew a valid frame 32 times; not checked"));
                    Ok(())
                }
            };
            checked.map_err(|error| format!("{label}: {error}"))?;
        }
    }
    ctx.note(format!("answers by code: {codes:?}"));
    // The connection still serves requests.
    session
        .hello_stream
        .send_frame(&Frame::ListStreams { request_id: 1 })
        .await?;
    session
        .hello_stream
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
        })
        .await
}

/// Expects the documented refusal of a handshake: `Error` (request id 0, `code`) on the hello
/// stream, then the connection closed with `code`.
pub(crate) async fn expect_refused_handshake(
    conn: &mut RawConn,
    stream: &mut RawStream,
    code: ErrorCode,
) -> Result<felix_wire::ErrorFrame, String> {
    let error = stream.expect_error(0, code).await?;
    match stream.next(STEP).await {
        Next::Fin | Next::Closed(_) => {}
        other => {
            return Err(format!(
                "after the refusal, expected the end of the hello stream, got {}",
                describe(&other)
            ));
        }
    }
    conn.expect_closed(code, STEP).await?;
    Ok(error)
}

/// Random bytes as the first bytes of a connection: the handshake is refused with the
/// decoder's code and the connection closed with it.
pub(crate) async fn random_bytes_on_the_hello_stream(ctx: &mut Ctx) -> Result<(), String> {
    let limits = ctx.limits();
    // Bodies within the smallest hello bound are judged alike under every setting.
    let decoder = Decoder::new(Limits {
        max_frame_bytes: HELLO_MAX_BYTES_FLOOR,
        ..limits
    });
    for sample in 0..8 {
        let with_header = sample % 2 == 1;
        let mut attempt = 0;
        let (bytes, expected) = loop {
            attempt += 1;
            let bytes = if with_header {
                let size = ctx.rng.random_range(0..=HELLO_MAX_BYTES_FLOOR as usize);
                let frame_type = if sample % 4 == 1 {
                    FrameType::Hello
                } else {
                    FrameType::ALL[ctx.rng.random_range(0..FrameType::ALL.len())]
                };
                let body = random_bytes(ctx, size);
                Body::new().bytes(&body).frame(frame_type as u8)
            } else {
                let size = ctx.rng.random_range(6..2000);
                Bytes::from(random_bytes(ctx, size))
            };
            let header_len = bytes
                .first_chunk::<4>()
                .map(|len| u32::from_le_bytes(*len))
                .unwrap_or(0);
            // Raw random bytes: only headers over every allowed hello bound are judged alike.
            let comparable = with_header || header_len > HELLO_MAX_BYTES_CEILING;
            let expected = verdict(&decoder, &bytes);
            if (comparable && expected != Verdict::Valid) || attempt >= 64 {
                break (bytes, expected);
            }
        };
        let code = match expected {
            Verdict::Error(error) => error.code(),
            // A valid non-Hello frame first is a protocol violation.
            Verdict::Valid => ErrorCode::ProtocolViolation,
            Verdict::Truncated => ErrorCode::Malformed,
        };
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        let _ = stream.send_fin(bytes).await;
        expect_refused_handshake(&mut conn, &mut stream, code)
            .await
            .map_err(|error| format!("sample {sample}: {error}"))?;
    }
    ctx.undocumented(
        "an undecodable Hello gets Error (request id 0, the decode error's code) on the hello \
         stream before the connection is closed with that code",
    );
    Ok(())
}

/// Each client request frame cut at every byte, then FIN.
pub(crate) async fn truncated_frames_then_fin(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("cut");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let mut cuts = 0;
    for (frame_type, frame) in frames::client_requests(&name) {
        let bytes = frames::encode(&frame);
        for cut in 0..bytes.len() {
            let mut stream = session.stream().await?;
            stream.send_fin(bytes.slice(..cut)).await?;
            let checked = if cut == 0 {
                stream.expect_fin().await
            } else {
                expect_truncated(&mut stream).await
            };
            checked.map_err(|error| {
                format!(
                    "{} cut to {cut} of {} bytes: {error}",
                    frame_type.name(),
                    bytes.len()
                )
            })?;
            cuts += 1;
        }
        // The whole frame then FIN: answered, then finished (a Subscribe stays a
        // subscription, see subscriber_half_close).
        if matches!(
            frame_type,
            FrameType::DescribeStream | FrameType::ListStreams | FrameType::Publish
        ) {
            let mut stream = session.stream().await?;
            stream.send_fin(bytes.clone()).await?;
            match stream.next(STEP).await {
                Next::Frame(Frame::StreamInfo(_) | Frame::StreamList { .. } | Frame::Ack(_)) => {}
                other => {
                    return Err(format!(
                        "a whole {} then FIN: expected its answer, got {}",
                        frame_type.name(),
                        describe(&other)
                    ));
                }
            }
            stream
                .expect_fin()
                .await
                .map_err(|error| format!("a whole {} then FIN: {error}", frame_type.name()))?;
        }
    }
    ctx.note(format!("{cuts} cuts, each on its own stream"));
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}

/// A Hello cut at every byte, then FIN, each on a new connection.
pub(crate) async fn truncated_hello_then_fin(ctx: &mut Ctx) -> Result<(), String> {
    let bytes = frames::encode(&frames::hello("felix-hostile"));
    for cut in 0..bytes.len() {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream.send_fin(bytes.slice(..cut)).await?;
        let code = if cut == 0 {
            ErrorCode::ProtocolViolation
        } else {
            ErrorCode::Malformed
        };
        expect_refused_handshake(&mut conn, &mut stream, code)
            .await
            .map_err(|error| format!("hello cut to {cut} of {} bytes: {error}", bytes.len()))?;
    }
    Ok(())
}

/// Every type code protocol v1 does not define, on its own request stream; and the order of
/// the header checks (size before type before flags).
pub(crate) async fn unknown_frame_types(ctx: &mut Ctx) -> Result<(), String> {
    let limits = ctx.limits();
    let mut session = ctx.session().await?;
    let mut unknown = 0;
    for code in 0..=u8::MAX {
        if FrameType::from_u8(code).is_some() {
            continue;
        }
        let bytes = Body::new().u64(1).frame(code);
        let mut stream = send_on_new_stream(&mut session, bytes).await?;
        stream
            .expect_stream_error(ErrorCode::UnknownFrameType)
            .await
            .map_err(|error| format!("type 0x{code:02x}: {error}"))?;
        unknown += 1;
    }
    ctx.note(format!("{unknown} unknown type codes refused"));
    let ordered = [
        (
            "an unknown type with body_len over max_frame_bytes",
            header(limits.max_frame_bytes.saturating_add(1), 0xee, 0),
            ErrorCode::FrameTooLarge,
        ),
        (
            "an unknown type with non-zero flags",
            Body::new().u64(1).frame_as(0xee, 8, 0x01),
            ErrorCode::UnknownFrameType,
        ),
    ];
    for (what, bytes, code) in ordered {
        let mut stream = send_on_new_stream(&mut session, bytes).await?;
        stream
            .expect_stream_error(code)
            .await
            .map_err(|error| format!("{what}: {error}"))?;
    }
    Ok(())
}

/// Non-zero flags on every known frame type.
pub(crate) async fn nonzero_flags(ctx: &mut Ctx) -> Result<(), String> {
    let limits = ctx.limits();
    let mut session = ctx.session().await?;
    for frame_type in FrameType::ALL {
        for flags in [0x01u8, 0x80, 0xff] {
            let bytes = Body::new().u64(1).frame_as(frame_type as u8, 8, flags);
            let mut stream = send_on_new_stream(&mut session, bytes).await?;
            stream
                .expect_stream_error(ErrorCode::Malformed)
                .await
                .map_err(|error| {
                    format!("{} with flags {flags:#04x}: {error}", frame_type.name())
                })?;
        }
    }
    // The size is judged before the flags.
    let bytes = header(
        limits.max_frame_bytes.saturating_add(1),
        FrameType::Publish as u8,
        1,
    );
    let mut stream = send_on_new_stream(&mut session, bytes).await?;
    stream
        .expect_stream_error(ErrorCode::FrameTooLarge)
        .await
        .map_err(|error| format!("an oversized publish with flags: {error}"))?;
    Ok(())
}

/// Every client request with one byte too many, one byte too few, and an empty body.
pub(crate) async fn trailing_and_missing_bytes(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("trailing");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let requests = frames::client_requests(&name);
    for (frame_type, frame) in &requests {
        let encoded = frames::encode(frame);
        let body = encoded.slice(felix_wire::FRAME_HEADER_LEN..);
        let variants = [
            (
                "a trailing byte",
                Body::new().bytes(&body).u8(0).frame(*frame_type as u8),
            ),
            (
                "its last byte missing",
                Body::new()
                    .bytes(&body[..body.len() - 1])
                    .frame(*frame_type as u8),
            ),
            ("an empty body", Body::new().frame(*frame_type as u8)),
        ];
        for (what, bytes) in variants {
            let mut stream = send_on_new_stream(&mut session, bytes).await?;
            stream
                .expect_stream_error(ErrorCode::Malformed)
                .await
                .map_err(|error| format!("{} with {what}: {error}", frame_type.name()))?;
        }
    }
    drop(session);
    // The same on the hello stream: the handshake is refused.
    let hello = frames::encode(&frames::hello("felix-hostile"));
    let body = hello.slice(felix_wire::FRAME_HEADER_LEN..);
    let variants = [
        (
            "a trailing byte",
            Body::new().bytes(&body).u8(0).frame(0x01),
        ),
        (
            "its last byte missing",
            Body::new().bytes(&body[..body.len() - 1]).frame(0x01),
        ),
        ("an empty body", Body::new().frame(0x01)),
    ];
    for (what, bytes) in variants {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        stream.send(bytes).await?;
        expect_refused_handshake(&mut conn, &mut stream, ErrorCode::Malformed)
            .await
            .map_err(|error| format!("hello with {what}: {error}"))?;
    }
    ctx.delete_stream(&name).await;
    Ok(())
}

/// One over-limit field: what is sent and what the broker must answer.
struct OverLimit {
    what: String,
    bytes: Bytes,
    code: ErrorCode,
}

fn over(what: impl Into<String>, bytes: Bytes, code: ErrorCode) -> OverLimit {
    OverLimit {
        what: what.into(),
        bytes,
        code,
    }
}

/// The over-limit variants of every client -> server frame (the hello stream aside), from the
/// broker's announced limits.
fn over_limit_frames(limits: &Limits, stream: &str) -> Vec<OverLimit> {
    use ErrorCode::{FrameTooLarge, LimitExceeded, Malformed};
    let mut out = Vec::new();
    let rid = 7u64;
    let name_lens: Vec<u16> = [limits.max_name_bytes.checked_add(1), Some(u16::MAX)]
        .into_iter()
        .flatten()
        .collect();
    let size_lens = [limits.max_frame_bytes.saturating_add(1), u32::MAX];
    let types = [
        FrameType::Hello,
        FrameType::CreateStream,
        FrameType::DescribeStream,
        FrameType::ListStreams,
        FrameType::DeleteStream,
        FrameType::Publish,
        FrameType::Subscribe,
    ];
    for frame_type in types {
        for len in size_lens {
            out.push(over(
                format!("{}: body_len {len}", frame_type.name()),
                header(len, frame_type as u8, 0),
                FrameTooLarge,
            ));
        }
    }
    // Stream names (their bytes absent: the length is judged first).
    for len in &name_lens {
        for frame_type in [
            FrameType::CreateStream,
            FrameType::DescribeStream,
            FrameType::DeleteStream,
            FrameType::Subscribe,
        ] {
            out.push(over(
                format!("{}: name length {len}", frame_type.name()),
                Body::new().u64(rid).u16(*len).frame(frame_type as u8),
                LimitExceeded,
            ));
        }
        out.push(over(
            format!("publish: name length {len}"),
            Body::new().u64(rid).u8(0).u16(*len).frame(0x20),
            LimitExceeded,
        ));
    }
    // A name at its limit whose bytes are missing: malformed.
    out.push(over(
        format!(
            "describe_stream: name length {} with no bytes",
            limits.max_name_bytes
        ),
        Body::new().u64(rid).u16(limits.max_name_bytes).frame(0x11),
        Malformed,
    ));
    // The hello's client name, on a request stream (decoded before it is misplaced).
    for len in [256u16, u16::MAX] {
        out.push(over(
            format!("hello on a request stream: client name length {len}"),
            Body::new().u16(1).u16(1).u64(0).u16(len).frame(0x01),
            LimitExceeded,
        ));
    }
    // Publish: record count, key, payload.
    let publish = || Body::new().u64(rid).u8(0).string(stream);
    for count in [limits.max_batch_records.saturating_add(1), u32::MAX] {
        if count > limits.max_batch_records {
            out.push(over(
                format!("publish: record count {count}"),
                publish().u32(count).frame(0x20),
                LimitExceeded,
            ));
        }
    }
    out.push(over(
        format!(
            "publish: record count {} with no records",
            limits.max_batch_records
        ),
        publish().u32(limits.max_batch_records).frame(0x20),
        Malformed,
    ));
    for len in [limits.max_key_bytes.checked_add(1), Some(u16::MAX)]
        .into_iter()
        .flatten()
    {
        if len > limits.max_key_bytes {
            // Six bytes follow the count (one record's smallest size), so the count passes its
            // byte check and the key length is judged.
            out.push(over(
                format!("publish: key length {len}"),
                publish().u32(1).u16(len).u32(0).frame(0x20),
                LimitExceeded,
            ));
        }
    }
    for len in [limits.max_payload_bytes.saturating_add(1), u32::MAX] {
        if len > limits.max_payload_bytes {
            out.push(over(
                format!("publish: payload length {len}"),
                publish().u32(1).string("k").u32(len).frame(0x20),
                LimitExceeded,
            ));
        }
    }
    // Subscribe: the shard list and the offsets list.
    let subscribe = || Body::new().u64(rid).string(stream);
    for count in [limits.max_shards.saturating_add(1), u32::MAX] {
        if count > limits.max_shards {
            out.push(over(
                format!("subscribe: shard list count {count}"),
                subscribe().u8(1).u32(count).frame(0x30),
                LimitExceeded,
            ));
            out.push(over(
                format!("subscribe: offsets count {count}"),
                subscribe().u8(0).u8(2).u32(count).frame(0x30),
                LimitExceeded,
            ));
        }
    }
    out.push(over(
        format!(
            "subscribe: shard list count {} with no shards",
            limits.max_shards
        ),
        subscribe().u8(1).u32(limits.max_shards).frame(0x30),
        Malformed,
    ));
    out.push(over(
        format!(
            "subscribe: offsets count {} with no entries",
            limits.max_shards
        ),
        subscribe().u8(0).u8(2).u32(limits.max_shards).frame(0x30),
        Malformed,
    ));
    // Enum values outside their tables.
    out.push(over(
        "create_stream: stream kind 2",
        Body::new().u64(rid).string("x").u32(1).u8(2).frame(0x10),
        Malformed,
    ));
    out.push(over(
        "publish: ack mode 2",
        Body::new().u64(rid).u8(2).string(stream).u32(0).frame(0x20),
        Malformed,
    ));
    out.push(over(
        "subscribe: shard selection 2",
        subscribe().u8(2).u8(0).frame(0x30),
        Malformed,
    ));
    out.push(over(
        "subscribe: start position 3",
        subscribe().u8(0).u8(3).frame(0x30),
        Malformed,
    ));
    out.push(over(
        "describe_stream: a name of invalid UTF-8",
        Body::new().u64(rid).str16(2, &[0xc3, 0x28]).frame(0x11),
        Malformed,
    ));
    out
}

/// Every length and count field of every client frame one past its limit and at its maximum,
/// each on its own request stream.
pub(crate) async fn fields_over_their_limits(ctx: &mut Ctx) -> Result<(), String> {
    let limits = ctx.limits();
    let name = ctx.unique_name("limits");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let variants = over_limit_frames(&limits, &name);
    let count = variants.len();
    let mut unnamed = Vec::new();
    for variant in variants {
        let mut stream = send_on_new_stream(&mut session, variant.bytes).await?;
        let error = stream
            .expect_stream_error(variant.code)
            .await
            .map_err(|error| format!("{}: {error}", variant.what))?;
        if variant.code == ErrorCode::LimitExceeded && !error.message.contains("FELIX_") {
            unnamed.push(error.message);
        }
    }
    ctx.note(format!(
        "{count} over-limit frames, each refused on its own stream"
    ));
    if let Some(example) = unnamed.first() {
        ctx.undocumented(format!(
            "limit_exceeded from the decoder names the field and the limit's value but not the \
             setting (e.g. {example:?}); wire-protocol.md 10 says every limit_exceeded message \
             names the setting"
        ));
    }
    // The connection is still served.
    session
        .hello_stream
        .send_frame(&Frame::ListStreams { request_id: 1 })
        .await?;
    session
        .hello_stream
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
        })
        .await?;
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}

/// `CreateStream.shard_count` over `max_shards`, at `u32::MAX`, and 0: answered with the
/// request's id, and the stream goes on.
pub(crate) async fn create_shard_count_over_limit(ctx: &mut Ctx) -> Result<(), String> {
    let limits = ctx.limits();
    let name = ctx.unique_name("wide");
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    let cases = [
        (
            1,
            limits.max_shards.saturating_add(1),
            ErrorCode::LimitExceeded,
        ),
        (2, u32::MAX, ErrorCode::LimitExceeded),
        (3, 0, ErrorCode::InvalidArgument),
    ];
    for (request_id, shard_count, code) in cases {
        stream
            .send_frame(&frames::create(request_id, &name, shard_count))
            .await?;
        let error = stream
            .expect_error(request_id, code)
            .await
            .map_err(|error| format!("shard_count {shard_count}: {error}"))?;
        if code == ErrorCode::LimitExceeded {
            ensure(
                error.message.contains("FELIX_MAX_SHARDS_PER_STREAM"),
                || format!("the message does not name the setting: {:?}", error.message),
            )?;
        }
    }
    stream
        .send_frame(&Frame::ListStreams { request_id: 4 })
        .await?;
    let listed = stream
        .expect_frame("StreamList", |frame| match frame {
            Frame::StreamList {
                request_id: 4,
                streams,
            } => Some(streams),
            _ => None,
        })
        .await?;
    ensure(!listed.iter().any(|summary| summary.name == name), || {
        format!("{name} was created by a refused request")
    })
}

/// The over-limit variants of a Hello (on the hello stream, before `HelloOk`); `hello_max`:
/// FELIX_HELLO_MAX_BYTES if known.
fn hello_over_limit_frames(hello_max: Option<u32>) -> Vec<OverLimit> {
    use ErrorCode::{FrameTooLarge, LimitExceeded, Malformed};
    let hello = |features: u64| Body::new().u16(1).u16(1).u64(features);
    let mut variants = vec![
        over(
            "body_len u32::MAX",
            header(u32::MAX, 0x01, 0),
            FrameTooLarge,
        ),
        over(
            "body_len over every allowed FELIX_HELLO_MAX_BYTES",
            header(HELLO_MAX_BYTES_CEILING + 1, 0x01, 0),
            FrameTooLarge,
        ),
        over(
            "client name length 256",
            hello(0).str16(256, &[b'n'; 256]).frame(0x01),
            LimitExceeded,
        ),
        over(
            "client name length 65535 (bytes absent)",
            hello(0).u16(u16::MAX).frame(0x01),
            LimitExceeded,
        ),
        over(
            "token length 1025 (bytes absent)",
            hello(FEATURE_TOKEN).string("c").u16(1025).frame(0x01),
            LimitExceeded,
        ),
        over(
            "token length 65535 (bytes absent)",
            hello(FEATURE_TOKEN).string("c").u16(u16::MAX).frame(0x01),
            LimitExceeded,
        ),
        over(
            "the TOKEN bit without a token",
            hello(FEATURE_TOKEN).string("c").frame(0x01),
            Malformed,
        ),
        over(
            "a client name of invalid UTF-8",
            hello(0).str16(2, &[0xc3, 0x28]).frame(0x01),
            Malformed,
        ),
    ];
    if let Some(max) = hello_max {
        variants.push(over(
            format!("body_len {} (FELIX_HELLO_MAX_BYTES + 1)", max + 1),
            header(max + 1, 0x01, 0),
            FrameTooLarge,
        ));
    }
    variants
}

/// Every field of a Hello past its limit, each on a new connection: refused with its code
/// (an Error on the hello stream, then the connection closed with that code).
pub(crate) async fn hello_fields_over_their_limits(ctx: &mut Ctx) -> Result<(), String> {
    for variant in hello_over_limit_frames(ctx.target().limits.hello_max_bytes) {
        let mut conn = ctx.connect().await?;
        let mut stream = conn.stream().await?;
        let _ = stream.send(variant.bytes).await;
        expect_refused_handshake(&mut conn, &mut stream, variant.code)
            .await
            .map_err(|error| format!("hello with {}: {error}", variant.what))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded_code(limits: Limits, bytes: &Bytes) -> Option<ErrorCode> {
        let mut buffer = BytesMut::from(&bytes[..]);
        Decoder::new(limits)
            .decode(&mut buffer)
            .err()
            .map(|error| error.code())
    }

    // Proves the suite expects of the broker, for each over-limit frame, the code the
    // reference decoder gives it (under the default limits and small ones).
    #[test]
    fn over_limit_frames_agree_with_the_reference_decoder() {
        let small = Limits {
            max_frame_bytes: 1 << 20,
            max_batch_records: 8,
            max_payload_bytes: 1024,
            max_key_bytes: 16,
            max_name_bytes: 32,
            max_shards: 16,
        };
        for limits in [Limits::DEFAULT, small] {
            for variant in over_limit_frames(&limits, "stream") {
                assert_eq!(
                    decoded_code(limits, &variant.bytes),
                    Some(variant.code),
                    "{}",
                    variant.what
                );
            }
        }
    }

    // Proves the Hello variants get their expected code from a decoder bounded by any allowed
    // FELIX_HELLO_MAX_BYTES (the smallest, the test's, the largest).
    #[test]
    fn hello_over_limit_frames_agree_with_the_reference_decoder() {
        for hello_max in [HELLO_MAX_BYTES_FLOOR, 2048, HELLO_MAX_BYTES_CEILING] {
            let limits = Limits {
                max_frame_bytes: hello_max,
                ..Limits::DEFAULT
            };
            for variant in hello_over_limit_frames(Some(hello_max)) {
                assert_eq!(
                    decoded_code(limits, &variant.bytes),
                    Some(variant.code),
                    "{} (hello max {hello_max})",
                    variant.what
                );
            }
        }
    }

    // Proves every truncation of a valid request is, for the reference decoder, an incomplete
    // frame (what the broker must call malformed once FIN comes).
    #[test]
    fn truncations_are_incomplete_frames() {
        let decoder = Decoder::new(Limits::DEFAULT);
        for (frame_type, frame) in frames::client_requests("stream") {
            let bytes = frames::encode(&frame);
            for cut in 1..bytes.len() {
                assert_eq!(
                    verdict(&decoder, &bytes[..cut]),
                    Verdict::Truncated,
                    "{} cut to {cut}",
                    frame_type.name()
                );
            }
            assert_eq!(verdict(&decoder, &bytes), Verdict::Valid);
        }
    }
}
