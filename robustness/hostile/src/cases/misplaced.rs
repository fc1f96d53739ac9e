//! Valid frames in the wrong place after the handshake: server-only frames from the client,
//! bytes after a `Subscribe`, a `Subscribe` that is not first on its stream, and a subscriber
//! that half-closes.

use bytes::Bytes;
use felix_client::record;
use felix_wire::{ErrorCode, Frame, ShardSelection, StartPosition};

use super::{Ctx, ensure};
use crate::frames;
use crate::raw::{Next, STEP, describe};

/// Every server -> client frame type sent by the client on a request stream, and one on the
/// hello stream after `HelloOk`.
pub(crate) async fn server_frames_from_the_client(ctx: &mut Ctx) -> Result<(), String> {
    let mut session = ctx.session().await?;
    let mut message = None;
    for frame in frames::server_frames() {
        let name = frame.frame_type().name();
        let mut stream = session.stream().await?;
        stream.send_frame(&frame).await?;
        let error = stream
            .expect_stream_error(ErrorCode::ProtocolViolation)
            .await
            .map_err(|error| format!("{name} from the client: {error}"))?;
        message.get_or_insert(error.message);
    }
    let ack = frames::server_frames()
        .into_iter()
        .find(|frame| matches!(frame, Frame::Ack(_)))
        .ok_or("no Ack frame")?;
    session.hello_stream.send_frame(&ack).await?;
    session
        .hello_stream
        .expect_stream_error(ErrorCode::ProtocolViolation)
        .await
        .map_err(|error| format!("an Ack on the hello stream after HelloOk: {error}"))?;
    let mut stream = session.stream().await?;
    stream
        .send_frame(&Frame::ListStreams { request_id: 1 })
        .await?;
    stream
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
        })
        .await
        .map_err(|error| format!("the connection afterwards: {error}"))?;
    ctx.note(format!("the message: {:?}", message.unwrap_or_default()));
    Ok(())
}

/// Bytes after a `Subscribe` on its stream: in the same write, a byte after `Subscribed`, a
/// whole frame after `Subscribed`.
pub(crate) async fn bytes_after_subscribe(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("extra");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let subscribe = frames::encode(&frames::subscribe(
        1,
        &name,
        ShardSelection::All,
        StartPosition::Latest,
    ));
    // With the Subscribe, in one write: Subscribed may or may not come first.
    let mut stream = session.stream().await?;
    let mut bytes = subscribe.to_vec();
    bytes.extend_from_slice(&frames::encode(&Frame::ListStreams { request_id: 2 }));
    stream.send(Bytes::from(bytes)).await?;
    let mut next = stream.next(STEP).await;
    if matches!(next, Next::Frame(Frame::Subscribed(_))) {
        ctx.note("Subscribe + ListStreams in one write: Subscribed came before the Error");
        next = stream.next(STEP).await;
    }
    match next {
        Next::Frame(Frame::Error(error))
            if error.request_id == 0 && error.code == ErrorCode::ProtocolViolation => {}
        other => {
            return Err(format!(
                "Subscribe + ListStreams in one write: expected Error protocol_violation \
                 (request id 0), got {}",
                describe(&other)
            ));
        }
    }
    stream
        .expect_fin()
        .await
        .map_err(|error| format!("Subscribe + ListStreams in one write: {error}"))?;
    // After Subscribed: one byte, then a whole frame.
    let extras = [
        ("one byte", Bytes::from_static(&[0])),
        (
            "a ListStreams",
            frames::encode(&Frame::ListStreams { request_id: 3 }),
        ),
    ];
    let mut ended = Vec::new();
    for (what, extra) in extras {
        let mut stream = session.stream().await?;
        stream.send(subscribe.clone()).await?;
        stream
            .expect_frame("Subscribed", |frame| {
                matches!(frame, Frame::Subscribed(_)).then_some(())
            })
            .await?;
        stream.send(extra).await?;
        let error = stream
            .expect_stream_error(ErrorCode::ProtocolViolation)
            .await
            .map_err(|error| format!("{what} after Subscribed: {error}"))?;
        ctx.note(format!("{what} after Subscribed: {:?}", error.message));
        ended.push(stream);
    }
    // Those subscriptions are over: a record published now reaches none of them (their streams
    // are finished, which expect_fin saw), and a new subscription on the connection works.
    let mut live = session.stream().await?;
    live.send(subscribe).await?;
    live.expect_frame("Subscribed", |frame| {
        matches!(frame, Frame::Subscribed(_)).then_some(())
    })
    .await?;
    ctx.admin()
        .publish(&name, &[record("k", "after")])
        .await
        .map_err(|error| format!("publish: {error}"))?;
    live.expect_frame("the record", |frame| {
        matches!(frame, Frame::Delivery(_)).then_some(())
    })
    .await?;
    drop((live, ended, session));
    ctx.delete_stream(&name).await;
    Ok(())
}

/// A `Subscribe` after another request on a request stream, and on the hello stream after
/// `HelloOk`: refused with its own request id; the stream goes on.
pub(crate) async fn subscribe_on_a_request_stream(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("misplaced");
    ctx.create_stream(&name, 1).await?;
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    stream
        .send_frame(&Frame::ListStreams { request_id: 1 })
        .await?;
    stream
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { request_id: 1, .. }).then_some(())
        })
        .await?;
    let subscribe = |request_id| {
        frames::subscribe(
            request_id,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        )
    };
    for (what, target) in [
        ("a request stream", &mut stream),
        ("the hello stream", &mut session.hello_stream),
    ] {
        target.send_frame(&subscribe(2)).await?;
        let error = target
            .expect_error(2, ErrorCode::ProtocolViolation)
            .await
            .map_err(|error| format!("a Subscribe on {what}: {error}"))?;
        ctx.note(format!("a Subscribe on {what}: {:?}", error.message));
        target
            .send_frame(&Frame::ListStreams { request_id: 3 })
            .await?;
        target
            .expect_frame("StreamList (the stream goes on)", |frame| {
                matches!(frame, Frame::StreamList { request_id: 3, .. }).then_some(())
            })
            .await
            .map_err(|error| format!("after a Subscribe on {what}: {error}"))?;
    }
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}

/// A subscriber that finishes its side right after `Subscribed` still gets deliveries.
pub(crate) async fn subscriber_half_close(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("halfclose");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    stream
        .send_frame(&frames::subscribe(
            1,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        ))
        .await?;
    stream
        .expect_frame("Subscribed", |frame| {
            matches!(frame, Frame::Subscribed(_)).then_some(())
        })
        .await?;
    stream.finish()?;
    ctx.admin()
        .publish(&name, &[record("k", "half-closed")])
        .await
        .map_err(|error| format!("publish: {error}"))?;
    let payload = stream
        .expect_frame("a Delivery after the half-close", |frame| match frame {
            Frame::Delivery(delivery) => delivery.records.first().map(|r| r.payload.clone()),
            _ => None,
        })
        .await?;
    ensure(payload == "half-closed", || {
        format!("delivered {payload:?}, not the record published")
    })?;
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}
