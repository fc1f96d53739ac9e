//! Well-formed requests naming what does not exist or cannot be: unknown streams, bad names,
//! empty publishes, shards out of range, bad start offsets, a stream deleted under a publisher
//! and a subscriber.

use std::collections::BTreeMap;

use felix_client::record;
use felix_wire::{AckMode, ErrorCode, Frame, ShardSelection, StartPosition};

use super::{Ctx, ensure};
use crate::frames;
use crate::raw::{Next, RawStream, STEP, describe};

/// Reads `count` answers on one stream (in any order) keyed by request id.
async fn answers(stream: &mut RawStream, count: usize) -> Result<BTreeMap<u64, Frame>, String> {
    let mut out = BTreeMap::new();
    while out.len() < count {
        match stream.next(STEP).await {
            Next::Frame(frame) => {
                let Some(request_id) = frame.request_id() else {
                    return Err(format!("an answer without a request id: {frame:?}"));
                };
                if let Some(previous) = out.insert(request_id, frame) {
                    return Err(format!(
                        "two answers for request {request_id} (first {previous:?})"
                    ));
                }
            }
            other => {
                return Err(format!(
                    "expected {count} answers, got {} then {}",
                    out.len(),
                    describe(&other)
                ));
            }
        }
    }
    Ok(out)
}

fn error_code(frame: Option<&Frame>) -> Option<ErrorCode> {
    match frame {
        Some(Frame::Error(error)) => Some(error.code),
        _ => None,
    }
}

/// Describe, delete, publish (acked and not) and subscribe naming a stream that does not exist.
pub(crate) async fn unknown_streams(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("missing");
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    let requests = [
        Frame::DescribeStream {
            request_id: 1,
            name: name.clone(),
        },
        Frame::DeleteStream {
            request_id: 2,
            name: name.clone(),
        },
        frames::publish(3, &name, &[("k", "v")], AckMode::Acked),
        frames::publish(0, &name, &[("k", "v")], AckMode::FireAndForget),
        Frame::ListStreams { request_id: 4 },
    ];
    for frame in &requests {
        stream.send_frame(frame).await?;
    }
    // The fire-and-forget publish has no answer: four answers, then nothing.
    let got = answers(&mut stream, 4).await?;
    for request_id in 1..=3 {
        ensure(
            error_code(got.get(&request_id)) == Some(ErrorCode::StreamNotFound),
            || {
                format!(
                    "request {request_id}: expected stream_not_found, got {:?}",
                    got.get(&request_id)
                )
            },
        )?;
    }
    ensure(
        matches!(got.get(&4), Some(Frame::StreamList { .. })),
        || format!("request 4: expected StreamList, got {:?}", got.get(&4)),
    )?;
    ensure(!got.contains_key(&0), || {
        "the fire-and-forget publish was answered".to_owned()
    })?;
    stream
        .expect_silence(std::time::Duration::from_millis(300))
        .await
        .map_err(|error| format!("after the answers: {error}"))?;
    let mut subscription = session.stream().await?;
    subscription
        .send_frame(&frames::subscribe(
            5,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        ))
        .await?;
    subscription
        .expect_error(5, ErrorCode::StreamNotFound)
        .await
        .map_err(|error| format!("subscribe: {error}"))?;
    subscription.expect_fin().await?;
    // A name that no stream can have.
    stream
        .send_frame(&Frame::DescribeStream {
            request_id: 6,
            name: "bad name!".to_owned(),
        })
        .await?;
    let answer = answers(&mut stream, 1).await?;
    let code = error_code(answer.get(&6));
    ensure(
        matches!(
            code,
            Some(ErrorCode::StreamNotFound | ErrorCode::InvalidArgument)
        ),
        || format!("describe \"bad name!\": {answer:?}"),
    )?;
    ctx.undocumented(format!(
        "describing an invalid stream name gets {}",
        code.map_or("?", ErrorCode::name)
    ));
    Ok(())
}

/// An empty acked publish, invalid names, a taken name: each refused with its request id.
pub(crate) async fn invalid_requests(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("taken");
    ctx.create_stream(&name, 1).await?;
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    let requests = [
        (
            frames::publish(1, &name, &[], AckMode::Acked),
            ErrorCode::InvalidArgument,
        ),
        (
            frames::create(2, "bad name!", 1),
            ErrorCode::InvalidArgument,
        ),
        (frames::create(3, "", 1), ErrorCode::InvalidArgument),
        (
            frames::create(4, "caf\u{e9}", 1),
            ErrorCode::InvalidArgument,
        ),
        (frames::create(5, &name, 1), ErrorCode::StreamExists),
    ];
    for (frame, _) in &requests {
        stream.send_frame(frame).await?;
    }
    let got = answers(&mut stream, requests.len()).await?;
    for (frame, code) in &requests {
        let request_id = frame.request_id().unwrap_or(0);
        ensure(error_code(got.get(&request_id)) == Some(*code), || {
            format!(
                "request {request_id} ({}): expected {}, got {:?}",
                frame.frame_type().name(),
                code.name(),
                got.get(&request_id)
            )
        })?;
    }
    // The stream goes on, and a fire-and-forget empty publish gets nothing.
    stream
        .send_frame(&frames::publish(0, &name, &[], AckMode::FireAndForget))
        .await?;
    stream
        .send_frame(&Frame::ListStreams { request_id: 6 })
        .await?;
    let got = answers(&mut stream, 1).await?;
    ensure(
        matches!(got.get(&6), Some(Frame::StreamList { .. })),
        || format!("expected StreamList 6 only, got {got:?}"),
    )?;
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}

/// Subscriptions with shards out of range, empty and duplicated lists, offsets for unselected
/// shards, duplicated offsets, offsets past `next_offset`; and the offset equal to it.
pub(crate) async fn subscribe_shard_errors(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("shards");
    ctx.create_stream(&name, 2).await?;
    let admin = ctx.admin();
    admin
        .publish(
            &name,
            &[record("a", "1"), record("b", "2"), record("c", "3")],
        )
        .await
        .map_err(|error| format!("publish: {error}"))?;
    let info = admin
        .describe_stream(&name)
        .await
        .map_err(|error| format!("describe: {error}"))?;
    let next = info
        .shards
        .iter()
        .find(|shard| shard.shard == 0)
        .map_or(0, |shard| shard.next_offset);
    use ShardSelection::{All, List};
    use StartPosition::{Latest, Offsets};
    let refused: Vec<(&str, ShardSelection, StartPosition, bool)> = vec![
        ("shard 2 of 2 in the list", List(vec![2]), Latest, true),
        (
            "shard u32::MAX in the list",
            List(vec![u32::MAX]),
            Latest,
            true,
        ),
        (
            "shard 2 of 2 in the offsets",
            All,
            Offsets(vec![(2, 0)]),
            true,
        ),
        (
            "an offset for an unselected shard",
            List(vec![0]),
            Offsets(vec![(1, 0)]),
            true,
        ),
        ("an empty shard list", List(Vec::new()), Latest, false),
        (
            "a duplicated shard list",
            List(vec![0, 1, 0]),
            Latest,
            false,
        ),
        (
            "two offsets for one shard",
            All,
            Offsets(vec![(0, 0), (0, 0)]),
            false,
        ),
        (
            "an offset past next_offset",
            All,
            Offsets(vec![(0, next + 1)]),
            false,
        ),
        ("offset u64::MAX", All, Offsets(vec![(0, u64::MAX)]), false),
    ];
    let mut session = ctx.session().await?;
    let mut request_id = 0;
    for (what, shards, from, documented) in refused {
        request_id += 1;
        let mut stream = session.stream().await?;
        stream
            .send_frame(&frames::subscribe(request_id, &name, shards, from))
            .await?;
        let error = stream
            .expect_error(request_id, ErrorCode::InvalidArgument)
            .await
            .map_err(|error| format!("{what}: {error}"))?;
        stream
            .expect_fin()
            .await
            .map_err(|error| format!("{what}: {error}"))?;
        if !documented {
            ctx.undocumented(format!(
                "a Subscribe with {what} gets invalid_argument with its request id ({:?}), the \
                 stream finished",
                error.message
            ));
        }
    }
    // Exactly next_offset: accepted, delivery starts there.
    request_id += 1;
    let mut stream = session.stream().await?;
    stream
        .send_frame(&frames::subscribe(
            request_id,
            &name,
            List(vec![0]),
            Offsets(vec![(0, next)]),
        ))
        .await?;
    let start = stream
        .expect_frame("Subscribed", |frame| match frame {
            Frame::Subscribed(subscribed) => Some(subscribed.shards),
            _ => None,
        })
        .await
        .map_err(|error| format!("an offset equal to next_offset: {error}"))?;
    ensure(start == vec![(0, next)], || {
        format!("an offset equal to next_offset {next}: Subscribed {start:?}")
    })?;
    drop(session);
    ctx.delete_stream(&name).await;
    Ok(())
}

/// A stream deleted under a publisher and a subscriber: the next acked publish gets
/// stream_not_found, the subscription ends with stream_not_found.
pub(crate) async fn publish_to_a_deleted_stream(ctx: &mut Ctx) -> Result<(), String> {
    let name = ctx.unique_name("doomed");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let mut requests = session.stream().await?;
    let mut subscription = session.stream().await?;
    subscription
        .send_frame(&frames::subscribe(
            9,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        ))
        .await?;
    subscription
        .expect_frame("Subscribed", |frame| {
            matches!(frame, Frame::Subscribed(_)).then_some(())
        })
        .await?;
    requests
        .send_frame(&frames::publish(
            1,
            &name,
            &[("k", "before")],
            AckMode::Acked,
        ))
        .await?;
    requests
        .expect_frame("Ack 1", |frame| {
            matches!(frame, Frame::Ack(ack) if ack.request_id == 1).then_some(())
        })
        .await?;
    ctx.admin()
        .delete_stream(&name)
        .await
        .map_err(|error| format!("delete: {error}"))?;
    requests
        .send_frame(&frames::publish(
            2,
            &name,
            &[("k", "after")],
            AckMode::Acked,
        ))
        .await?;
    let error = requests
        .expect_error(2, ErrorCode::StreamNotFound)
        .await
        .map_err(|error| format!("a publish after the delete: {error}"))?;
    ensure(error.message.contains(&name), || {
        format!("the message does not name the stream: {:?}", error.message)
    })?;
    // The subscription got the record before the delete, then its end.
    let mut delivered = 0;
    let ended = loop {
        match subscription.next(STEP).await {
            Next::Frame(Frame::Delivery(delivery)) => delivered += delivery.records.len(),
            Next::Frame(Frame::Error(error)) if error.code == ErrorCode::StreamNotFound => {
                break error;
            }
            other => {
                return Err(format!(
                    "the subscription: expected stream_not_found, got {}",
                    describe(&other)
                ));
            }
        }
    };
    subscription.expect_fin().await?;
    ensure(delivered == 1, || {
        format!("the subscription got {delivered} records before its end, not 1")
    })?;
    ctx.undocumented(format!(
        "the Error ending a subscription of a deleted stream carries the Subscribe's request \
         id: {} (sent 9)",
        ended.request_id
    ));
    ensure(ended.request_id == 9, || {
        format!(
            "the subscription's end carries request id {}, not its Subscribe's 9",
            ended.request_id
        )
    })?;
    // The request stream goes on.
    requests
        .send_frame(&Frame::ListStreams { request_id: 3 })
        .await?;
    let listed = requests
        .expect_frame("StreamList 3", |frame| match frame {
            Frame::StreamList {
                request_id: 3,
                streams,
            } => Some(streams),
            _ => None,
        })
        .await?;
    ensure(!listed.iter().any(|summary| summary.name == name), || {
        format!("{name} is still listed after its delete")
    })
}

/// Acked publishes pipelined on one stream while the stream is deleted: each gets exactly one
/// answer (an Ack or stream_not_found), and no publish after a refused one is acked.
pub(crate) async fn publishes_racing_a_delete(ctx: &mut Ctx) -> Result<(), String> {
    const PUBLISHES: u64 = 200;
    const CHUNK: u64 = 20;
    let name = ctx.unique_name("race");
    ctx.create_stream(&name, 1).await?;
    let mut session = ctx.session().await?;
    let mut stream = session.stream().await?;
    let admin = ctx.admin();
    let publisher = async {
        for chunk in 0..PUBLISHES / CHUNK {
            let mut bytes = Vec::new();
            for index in 0..CHUNK {
                let request_id = chunk * CHUNK + index + 1;
                bytes.extend_from_slice(&frames::encode(&frames::publish(
                    request_id,
                    &name,
                    &[("key", "racing")],
                    AckMode::Acked,
                )));
            }
            stream.send(bytes::Bytes::from(bytes)).await?;
            tokio::task::yield_now().await;
        }
        Ok::<(), String>(())
    };
    let deleter = async {
        tokio::task::yield_now().await;
        admin
            .delete_stream(&name)
            .await
            .map_err(|error| format!("delete: {error}"))
    };
    let (published, deleted) = tokio::join!(publisher, deleter);
    published?;
    deleted?;
    let mut got = answers(
        &mut stream,
        usize::try_from(PUBLISHES).unwrap_or(usize::MAX),
    )
    .await?;
    // One more, surely after the delete.
    let last = PUBLISHES + 1;
    stream
        .send_frame(&frames::publish(
            last,
            &name,
            &[("key", "late")],
            AckMode::Acked,
        ))
        .await?;
    got.append(&mut answers(&mut stream, 1).await?);
    let mut acked = Vec::new();
    let mut refused = Vec::new();
    for (request_id, frame) in &got {
        match frame {
            Frame::Ack(_) => acked.push(*request_id),
            Frame::Error(error) if error.code == ErrorCode::StreamNotFound => {
                refused.push(*request_id);
            }
            other => return Err(format!("request {request_id}: unexpected answer {other:?}")),
        }
    }
    ensure(got.keys().copied().eq(1..=last), || {
        "answers are missing for some request ids".to_owned()
    })?;
    let last_acked = acked.iter().max().copied().unwrap_or(0);
    let first_refused = refused.iter().min().copied().unwrap_or(u64::MAX);
    ensure(last_acked < first_refused, || {
        format!(
            "publish {last_acked} was acked after publish {first_refused} was refused \
             (stream_not_found)"
        )
    })?;
    ensure(refused.contains(&last), || {
        format!(
            "the publish after the delete was not refused: {:?}",
            got.get(&last)
        )
    })?;
    ctx.note(format!(
        "{} acked, then {} refused with stream_not_found",
        acked.len(),
        refused.len()
    ));
    Ok(())
}
