//! Clients that take more than their share: floods of connections, streams and subscriptions
//! beyond the limits, a subscriber that never reads, streams that carry nothing or half a
//! frame; and the final check that nothing they held is left behind.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_client::{ShardSelection, StartPosition, record};
use felix_wire::{ErrorCode, Frame};
use futures::StreamExt as _;

use super::{Ctx, ensure};
use crate::frames::{self, Body};
use crate::raw::{Closed, Next, RawConn, RawStream, STEP, describe};

/// What happened to one connection attempt of a flood.
enum Attempt {
    Accepted(Box<(RawConn, RawStream)>),
    /// Refused: whether an Error frame came first, and how the connection ended.
    Refused {
        error: Option<felix_wire::ErrorFrame>,
        closed: Option<Closed>,
    },
}

/// Connects to `addr` and sends the standard Hello.
async fn attempt(ctx: &Ctx, addr: std::net::SocketAddr) -> Result<Attempt, String> {
    let mut conn = match RawConn::connect(ctx.target(), addr, true).await {
        Ok(conn) => conn,
        Err(Ok(closed)) => {
            return Ok(Attempt::Refused {
                error: None,
                closed: Some(closed),
            });
        }
        Err(Err(error)) => return Err(error),
    };
    let mut stream = match conn.stream().await {
        Ok(stream) => stream,
        Err(_) => {
            let closed = conn.closed(STEP).await;
            return Ok(Attempt::Refused {
                error: None,
                closed,
            });
        }
    };
    let _ = stream
        .send_frame(&frames::hello("felix-hostile-flood"))
        .await;
    match stream.next(STEP).await {
        Next::Frame(Frame::HelloOk(_)) => Ok(Attempt::Accepted(Box::new((conn, stream)))),
        Next::Frame(Frame::Error(error)) => {
            let closed = conn.closed(STEP).await;
            Ok(Attempt::Refused {
                error: Some(error),
                closed,
            })
        }
        Next::Closed(closed) => Ok(Attempt::Refused {
            error: None,
            closed: Some(closed),
        }),
        other => Err(format!(
            "a flood connection: unexpected {}",
            describe(&other)
        )),
    }
}

/// After a flood's connections are gone, a new one to `addr` is accepted (the broker frees
/// the slots as it learns of the closes).
async fn accepted_again(ctx: &Ctx, addr: std::net::SocketAddr) -> Result<(), String> {
    let deadline = Instant::now() + STEP;
    loop {
        match attempt(ctx, addr).await? {
            Attempt::Accepted(..) => return Ok(()),
            Attempt::Refused { .. } if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Attempt::Refused { error, closed } => {
                return Err(format!(
                    "after the flood, a new connection is still refused: {error:?} {closed:?}"
                ));
            }
        }
    }
}

/// Connections to one core's own port beyond FELIX_MAX_CONNECTIONS_PER_CORE.
pub(crate) async fn connections_per_core(ctx: &mut Ctx) -> Result<(), String> {
    let Some(limit) = ctx.target().limits.connections_per_core else {
        ctx.skip("FELIX_MAX_CONNECTIONS_PER_CORE unknown");
        return Ok(());
    };
    if let Some(principal) = ctx.target().limits.connections_per_principal
        && principal != 0
        && principal <= limit + 2
    {
        ctx.skip("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL would refuse first");
        return Ok(());
    }
    let addr = *ctx.core_addrs().first().ok_or("no core address")?;
    let mut accepted = Vec::new();
    let mut refusals = Vec::new();
    for _ in 0..limit + 3 {
        match attempt(ctx, addr).await? {
            Attempt::Accepted(accepted_conn) => {
                ensure(refusals.is_empty(), || {
                    "a connection was accepted after one was refused".to_owned()
                })?;
                accepted.push(*accepted_conn);
            }
            Attempt::Refused { error, closed } => refusals.push((error, closed)),
        }
        if refusals.len() >= 2 {
            break;
        }
    }
    // The healthy client may hold a connection on this core: at most `limit` of ours.
    ensure(accepted.len() <= limit as usize, || {
        format!(
            "{} connections accepted on core 0, over its limit of {limit}",
            accepted.len()
        )
    })?;
    ensure(accepted.len() + 2 >= limit as usize, || {
        format!(
            "only {} connections accepted before the first refusal (limit {limit})",
            accepted.len()
        )
    })?;
    ensure(!refusals.is_empty(), || {
        format!(
            "no connection refused after {} (limit {limit})",
            accepted.len()
        )
    })?;
    let mut with_error = 0;
    for (error, closed) in &refusals {
        ensure(
            closed
                .as_ref()
                .is_some_and(|closed| closed.is_peer_code(ErrorCode::LimitExceeded)),
            || format!("a refused connection ended with {closed:?}, not close code 6"),
        )?;
        if let Some(error) = error {
            ensure(error.code == ErrorCode::LimitExceeded, || {
                format!("a refused connection got {error:?}")
            })?;
            with_error += 1;
        }
    }
    ctx.note(format!(
        "{} accepted on core 0, then {} refused with close code 6 ({with_error} of them with an \
         Error frame first)",
        accepted.len(),
        refusals.len()
    ));
    if with_error == 0 {
        ctx.undocumented(
            "a connection over FELIX_MAX_CONNECTIONS_PER_CORE is closed with 6 at once, with no \
             Error on a hello stream: security.md says so, wire-protocol.md 10 promises an \
             Error limit_exceeded on the hello stream first",
        );
    }
    // The accepted ones still work.
    for (_, stream) in accepted.iter_mut().take(2) {
        stream
            .send_frame(&Frame::ListStreams { request_id: 1 })
            .await?;
        stream
            .expect_frame("StreamList", |frame| {
                matches!(frame, Frame::StreamList { .. }).then_some(())
            })
            .await?;
    }
    drop(accepted);
    accepted_again(ctx, addr).await
}

/// Connections of one principal (anonymous), spread over every core, beyond
/// FELIX_MAX_CONNECTIONS_PER_PRINCIPAL.
pub(crate) async fn connections_per_principal(ctx: &mut Ctx) -> Result<(), String> {
    let limit = match ctx.target().limits.connections_per_principal {
        None => {
            ctx.skip("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL unknown");
            return Ok(());
        }
        Some(0) => {
            ctx.skip("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL is 0 (no limit)");
            return Ok(());
        }
        Some(limit) => limit,
    };
    let cores = ctx.core_addrs().to_vec();
    if let Some(per_core) = ctx.target().limits.connections_per_core
        && u64::from(per_core) * cores.len() as u64 <= u64::from(limit) + 2
    {
        ctx.skip("FELIX_MAX_CONNECTIONS_PER_CORE would refuse first");
        return Ok(());
    }
    let mut accepted = Vec::new();
    let mut refusals = Vec::new();
    for index in 0..limit as usize + 3 {
        let addr = cores[index % cores.len()];
        match attempt(ctx, addr).await? {
            Attempt::Accepted(accepted_conn) => {
                ensure(refusals.is_empty(), || {
                    "a connection was accepted after one was refused".to_owned()
                })?;
                accepted.push(*accepted_conn);
            }
            Attempt::Refused { error, closed } => refusals.push((error, closed)),
        }
        if refusals.len() >= 2 {
            break;
        }
    }
    // The healthy client is anonymous too: at most `limit - 1` of ours.
    ensure(accepted.len() < limit as usize, || {
        format!(
            "{} connections accepted, with the healthy client's over the limit of {limit}",
            accepted.len()
        )
    })?;
    ensure(accepted.len() + 3 >= limit as usize, || {
        format!(
            "only {} accepted before the first refusal (limit {limit})",
            accepted.len()
        )
    })?;
    ensure(!refusals.is_empty(), || {
        format!(
            "no connection refused after {} (limit {limit})",
            accepted.len()
        )
    })?;
    for (error, closed) in &refusals {
        let Some(error) = error else {
            return Err(format!(
                "a refused connection got no Error on its hello stream (ended {closed:?})"
            ));
        };
        ensure(
            error.code == ErrorCode::LimitExceeded
                && error.request_id == 0
                && error
                    .message
                    .contains("FELIX_MAX_CONNECTIONS_PER_PRINCIPAL")
                && error.message.contains(&limit.to_string()),
            || format!("a refused connection got {error:?}"),
        )?;
        ensure(
            closed
                .as_ref()
                .is_some_and(|closed| closed.is_peer_code(ErrorCode::LimitExceeded)),
            || format!("a refused connection ended with {closed:?}, not close code 6"),
        )?;
    }
    ctx.note(format!(
        "{} accepted over {} cores, then {} refused",
        accepted.len(),
        cores.len(),
        refusals.len()
    ));
    let first = cores.first().copied().ok_or("no core address")?;
    drop(accepted);
    accepted_again(ctx, first).await
}

/// Streams of one connection beyond FELIX_MAX_STREAMS_PER_CONNECTION.
pub(crate) async fn streams_per_connection(ctx: &mut Ctx) -> Result<(), String> {
    /// Streams QUIC lets a client open beyond the limit (docs/security.md).
    const QUIC_SLACK: u32 = 8;
    let Some(limit) = ctx.target().limits.streams_per_connection else {
        ctx.skip("FELIX_MAX_STREAMS_PER_CONNECTION unknown");
        return Ok(());
    };
    let mut session = ctx.session().await?;
    // The hello stream is one of them.
    let mut open = Vec::new();
    for index in 1..limit {
        let mut stream = session.stream().await?;
        stream
            .send_frame(&Frame::ListStreams {
                request_id: u64::from(index),
            })
            .await?;
        stream
            .expect_frame("StreamList", |frame| {
                matches!(frame, Frame::StreamList { .. }).then_some(())
            })
            .await
            .map_err(|error| format!("stream {} of {limit}: {error}", index + 1))?;
        open.push(stream);
    }
    let mut refused = Vec::new();
    let mut held_back = false;
    for extra in 0..QUIC_SLACK + 1 {
        let Some(mut stream) = session.conn.try_stream(Duration::from_secs(2)).await? else {
            held_back = true;
            ctx.note(format!(
                "QUIC held back the stream {} past the limit",
                extra + 1
            ));
            break;
        };
        stream
            .send_frame(&Frame::ListStreams { request_id: 99 })
            .await?;
        let error = stream
            .expect_stream_error(ErrorCode::LimitExceeded)
            .await
            .map_err(|error| format!("stream {} past the limit: {error}", extra + 1))?;
        ensure(
            error.message.contains("FELIX_MAX_STREAMS_PER_CONNECTION")
                && error.detail == u64::from(limit),
            || format!("stream {} past the limit: {error:?}", extra + 1),
        )?;
        refused.push(stream);
    }
    if !held_back {
        ctx.undocumented(format!(
            "QUIC did not stop the client {QUIC_SLACK} streams past the limit: the refused \
             streams are closed by the broker, which gives their QUIC credit back (every stream \
             past the limit is still refused)"
        ));
    }
    // The open ones still work; once one closes, a new stream is served again.
    open[0]
        .send_frame(&Frame::ListStreams { request_id: 100 })
        .await?;
    open[0]
        .expect_frame("StreamList", |frame| {
            matches!(frame, Frame::StreamList { .. }).then_some(())
        })
        .await?;
    drop(refused);
    open[0].finish()?;
    open[0].expect_fin().await?;
    let deadline = Instant::now() + STEP;
    loop {
        let mut stream = session.stream().await?;
        stream
            .send_frame(&Frame::ListStreams { request_id: 101 })
            .await?;
        match stream.next(STEP).await {
            Next::Frame(Frame::StreamList { .. }) => break,
            Next::Frame(Frame::Error(error))
                if error.code == ErrorCode::LimitExceeded && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => {
                return Err(format!(
                    "after a stream closed, a new one: {}",
                    describe(&other)
                ));
            }
        }
    }
    Ok(())
}

/// Subscriptions of one connection beyond FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION.
pub(crate) async fn subscriptions_per_connection(ctx: &mut Ctx) -> Result<(), String> {
    const EXTRA: u32 = 3;
    let Some(limit) = ctx.target().limits.subscriptions_per_connection else {
        ctx.skip("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION unknown");
        return Ok(());
    };
    if let Some(streams) = ctx.target().limits.streams_per_connection
        && streams < limit + EXTRA + 2
    {
        ctx.skip("FELIX_MAX_STREAMS_PER_CONNECTION too low to reach it");
        return Ok(());
    }
    let name = ctx.unique_name("subs");
    ctx.create_stream(&name, 2).await?;
    let mut session = ctx.session().await?;
    let subscribe = |request_id: u64| {
        frames::subscribe(
            request_id,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        )
    };
    let mut live = Vec::new();
    for index in 0..limit {
        let mut stream = session.stream().await?;
        stream.send_frame(&subscribe(u64::from(index) + 1)).await?;
        stream
            .expect_frame("Subscribed", |frame| {
                matches!(frame, Frame::Subscribed(_)).then_some(())
            })
            .await
            .map_err(|error| format!("subscription {} of {limit}: {error}", index + 1))?;
        live.push(stream);
    }
    for extra in 0..EXTRA {
        let request_id = u64::from(limit + extra) + 1;
        let mut stream = session.stream().await?;
        stream.send_frame(&subscribe(request_id)).await?;
        let error = stream
            .expect_error(request_id, ErrorCode::LimitExceeded)
            .await
            .map_err(|error| format!("subscription {request_id}: {error}"))?;
        stream.expect_fin().await?;
        ensure(
            error
                .message
                .contains("FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION")
                && error.detail == u64::from(limit),
            || format!("subscription {request_id}: {error:?}"),
        )?;
    }
    // The live ones are served; once one ends, a new subscription is accepted.
    ctx.admin()
        .publish(&name, &[record("k", "to every subscriber")])
        .await
        .map_err(|error| format!("publish: {error}"))?;
    for stream in &mut live {
        stream
            .expect_frame("the Delivery", |frame| {
                matches!(frame, Frame::Delivery(_)).then_some(())
            })
            .await?;
    }
    let mut ended = live.remove(0);
    let _ = ended.stream.stop_sending(0u32.into());
    let _ = ended.stream.reset(0u32.into());
    drop(ended);
    let deadline = Instant::now() + STEP;
    let mut request_id = 100;
    loop {
        request_id += 1;
        let mut stream = session.stream().await?;
        stream.send_frame(&subscribe(request_id)).await?;
        match stream.next(STEP).await {
            Next::Frame(Frame::Subscribed(_)) => break,
            Next::Frame(Frame::Error(error))
                if error.code == ErrorCode::LimitExceeded && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => {
                return Err(format!(
                    "after a subscription ended, a new one: {}",
                    describe(&other)
                ));
            }
        }
    }
    drop((live, session));
    ctx.delete_stream(&name).await;
    Ok(())
}

/// A subscriber that never reads while a healthy subscriber of the same stream reads every
/// record: memory stays bounded, the healthy one gets everything, the stalled one ends with
/// subscriber_lagged.
pub(crate) async fn stalled_subscriber(ctx: &mut Ctx) -> Result<(), String> {
    const PAYLOAD_BYTES: usize = 16 * 1024;
    const BATCH: usize = 16;
    let bound = ctx.target().limits.subscriber_queue_max_bytes;
    // 64 MiB (or 64 times a larger backlog bound, up to 256 MiB): far more than the bound, so
    // a subscriber backlog without one would show in the broker's memory.
    let total = bound.map_or(64 << 20, |bound| (bound * 64).clamp(64 << 20, 256 << 20));
    let batches = usize::try_from(total).unwrap_or(usize::MAX) / (PAYLOAD_BYTES * BATCH);
    let records = batches * BATCH;
    let name = ctx.unique_name("stall");
    ctx.create_stream(&name, 2).await?;
    let before = ctx.sample("stalled_subscriber: before");
    let mut session = ctx.session().await?;
    let mut stalled = session.stream().await?;
    stalled
        .send_frame(&frames::subscribe(
            7,
            &name,
            ShardSelection::All,
            StartPosition::Latest,
        ))
        .await?;
    stalled
        .expect_frame("Subscribed", |frame| {
            matches!(frame, Frame::Subscribed(_)).then_some(())
        })
        .await?;
    let admin = ctx.admin();
    let mut reading = admin
        .subscribe(&name, ShardSelection::All, StartPosition::Latest)
        .await
        .map_err(|error| format!("the reading subscriber: {error}"))?;
    let (progress, mut received) = tokio::sync::watch::channel(0usize);
    let reader = tokio::spawn(async move {
        let mut got = 0usize;
        while got < records {
            match tokio::time::timeout(STEP, reading.next()).await {
                Ok(Some(Ok(_))) => got += 1,
                other => {
                    return Err(format!(
                        "the reading subscriber ended after {got}: {other:?}"
                    ));
                }
            }
            progress.send_replace(got);
        }
        Ok(got)
    });
    let payload = Bytes::from(vec![b'x'; PAYLOAD_BYTES]);
    let started = Instant::now();
    let mut peak = before.unwrap_or(0);
    let mut halves = [Duration::ZERO; 2];
    for batch in 0..batches {
        let batch_started = Instant::now();
        let records: Vec<_> = (0..BATCH)
            .map(|index| record(format!("k{batch}-{index}"), payload.clone()))
            .collect();
        admin
            .publish(&name, &records)
            .await
            .map_err(|error| format!("publish batch {batch}: {error}"))?;
        let sent = (batch + 1) * BATCH;
        // The reader stays within one batch: its own backlog never nears the bound.
        tokio::time::timeout(STEP, received.wait_for(|&got| got + BATCH >= sent))
            .await
            .map_err(|_| format!("the reading subscriber stalled at batch {batch}"))?
            .map_err(|_| "the reading subscriber is gone".to_owned())?;
        halves[usize::from(batch >= batches / 2)] += batch_started.elapsed();
        if batch % 32 == 31
            && let Some(rss) = ctx.sample(&format!("stalled_subscriber: batch {}", batch + 1))
        {
            peak = peak.max(rss);
        }
    }
    let got = tokio::time::timeout(STEP, reader)
        .await
        .map_err(|_| "the reading subscriber did not finish".to_owned())?
        .map_err(|error| format!("the reader task: {error}"))??;
    ensure(got == records, || {
        format!("the reader got {got} of {records}")
    })?;
    let elapsed = started.elapsed();
    let rate = |time: Duration| (records / 2) as f64 / time.as_secs_f64().max(1e-3);
    ctx.note(format!(
        "{records} records of {PAYLOAD_BYTES} bytes ({} MiB) in {elapsed:.1?} past a stalled \
         subscriber; the healthy reader's rate: {:.0} records/s in the first half, {:.0} in the \
         second; broker RSS {} MiB before, peak {} MiB",
        total >> 20,
        rate(halves[0]),
        rate(halves[1]),
        before.unwrap_or(0) >> 20,
        peak >> 20
    ));
    // Reading now, the stalled subscriber finds deliveries, then its end: an Error
    // subscriber_lagged with resume positions, then the end of the stream (wire-protocol.md
    // 10); or, once it stalled past the broker's grace, its stream reset with code 21.
    let mut delivered = 0usize;
    let mut frames_read = 0usize;
    let ended = loop {
        frames_read += 1;
        ensure(frames_read <= records + 16, || {
            "the stalled subscription never ended".to_owned()
        })?;
        match stalled.next(STEP).await {
            Next::Frame(Frame::Delivery(delivery)) => delivered += delivery.records.len(),
            Next::Frame(Frame::Error(error)) => break Some(Ok(error)),
            Next::Reset(code) => break Some(Err(code)),
            Next::Silent if bound.is_none() && delivered == records => break None,
            other => {
                return Err(format!(
                    "the stalled subscriber, reading after {delivered} records: {}",
                    describe(&other)
                ));
            }
        }
    };
    match ended {
        Some(Ok(error)) => {
            ensure(error.code == ErrorCode::SubscriberLagged, || {
                format!("the stalled subscription ended with {error:?}")
            })?;
            ensure(
                error.message.contains("0:") || error.message.contains("1:"),
                || {
                    format!(
                        "no shard:next_offset resume positions in {:?}",
                        error.message
                    )
                },
            )?;
            stalled.expect_fin().await?;
            ctx.note(format!(
                "the stalled subscriber read {delivered} records, then subscriber_lagged \
                 (request id {}): {:?}",
                error.request_id, error.message
            ));
            ctx.undocumented(format!(
                "the Error ending a lagged subscription carries the Subscribe's request id ({} \
                 for 7)",
                error.request_id
            ));
        }
        Some(Err(code)) => {
            ensure(code == ErrorCode::SubscriberLagged as u64, || {
                format!("the stalled subscription's stream was reset with code {code}, not 21")
            })?;
            ctx.note(format!(
                "the stalled subscriber read {delivered} records, then found its stream reset \
                 with code 21 (subscriber_lagged)"
            ));
            ctx.undocumented(
                "a subscriber that stalls (withholds QUIC credit) past its subscription's end \
                 gets its stream reset with the ending error's code (21) after a grace, not \
                 the Error frame and FIN wire-protocol.md 10 describes; the resume positions \
                 are lost to it",
            );
        }
        None => ctx.note("the stalled subscriber got every record (the backlog bound is larger)"),
    }
    drop((stalled, session));
    ctx.delete_stream(&name).await;
    Ok(())
}

/// Streams that carry nothing, a partial header, a partial body, or most of a frame at the
/// frame limit (on every stream the connection has left), held open in silence; then
/// completed or cut by FIN. The broker's memory while it holds them is measured.
pub(crate) async fn silent_and_partial_streams(ctx: &mut Ctx) -> Result<(), String> {
    /// Bytes of a partial frame held per stream, at most (of the frame limit).
    const HELD_MAX: usize = 4 << 20;
    let limits = ctx.limits();
    let hold = ctx
        .target()
        .limits
        .hello_timeout
        .map_or(Duration::from_secs(3), |timeout| {
            (timeout * 2).max(Duration::from_secs(3))
        });
    // The hello stream, 2 empty, 2 partial headers and 1 partial body: the rest hold big
    // partial frames.
    let big_streams = ctx
        .target()
        .limits
        .streams_per_connection
        .map_or(4, |limit| limit.saturating_sub(6).min(8) as usize);
    let mut session = ctx.session().await?;
    // No byte at all: QUIC opens lower stream ids implicitly, so the broker holds these too.
    let mut empty = Vec::new();
    for _ in 0..2 {
        empty.push(session.stream().await?);
    }
    let mut partial_header = Vec::new();
    for _ in 0..2 {
        let mut stream = session.stream().await?;
        stream.send(Bytes::from_static(&[8, 0, 0])).await?;
        partial_header.push(stream);
    }
    let list = frames::encode(&Frame::ListStreams { request_id: 5 });
    let mut partial_body = session.stream().await?;
    partial_body.send(list.slice(..10)).await?;
    // Most of a frame at the frame limit on each remaining stream: the broker buffers them.
    let announced = limits.max_frame_bytes;
    let held = usize::try_from(announced)
        .unwrap_or(usize::MAX)
        .min(HELD_MAX)
        - 1;
    let before = ctx.sample("silent_and_partial_streams: before");
    let chunk = Bytes::from(vec![0u8; 64 * 1024]);
    let mut big = Vec::new();
    for _ in 0..big_streams {
        let mut stream = session.stream().await?;
        stream
            .send(Body::new().frame_as(0x20, announced, 0))
            .await?;
        let mut sent = 0;
        while sent < held {
            let len = chunk.len().min(held - sent);
            stream.send(chunk.slice(..len)).await?;
            sent += len;
        }
        big.push(stream);
    }
    tokio::time::sleep(hold).await;
    let during = ctx.sample("silent_and_partial_streams: holding");
    for stream in partial_header
        .iter_mut()
        .chain([&mut partial_body])
        .chain(big.iter_mut())
    {
        stream
            .expect_silence(Duration::from_millis(200))
            .await
            .map_err(|error| format!("a partial frame held for {hold:?}: {error}"))?;
    }
    // The connection still serves its hello stream.
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
    // Completed: answered. Cut by FIN: malformed.
    partial_body.send(list.slice(10..)).await?;
    partial_body
        .expect_frame("StreamList 5", |frame| {
            matches!(frame, Frame::StreamList { request_id: 5, .. }).then_some(())
        })
        .await
        .map_err(|error| format!("the completed partial frame: {error}"))?;
    for stream in partial_header.iter_mut().chain(big.iter_mut()) {
        stream.finish()?;
        let error = stream.expect_stream_error(ErrorCode::Malformed).await?;
        ensure(error.message.contains("ended inside a frame"), || {
            format!("a partial frame cut by FIN: {:?}", error.message)
        })?;
    }
    // The empty streams, finished, are finished in turn.
    for stream in &mut empty {
        stream.finish()?;
        stream.expect_fin().await?;
    }
    drop(big);
    let after = ctx.sample("silent_and_partial_streams: after");
    let total = (held * big_streams) as u64;
    if let (Some(before), Some(during), Some(after)) = (before, during, after) {
        ctx.note(format!(
            "broker RSS holding {big_streams} partial frames of {held} bytes ({} MiB) on one \
             connection: {} MiB before, {} MiB holding, {} MiB after",
            total >> 20,
            before >> 20,
            during >> 20,
            after >> 20
        ));
        // Bounded by the frame limit per stream (a buffer may double while it grows).
        let grown = during.saturating_sub(before);
        ensure(grown <= 2 * total + (16 << 20), || {
            format!(
                "holding {total} bytes of partial frames grew the broker by {grown} bytes, \
                 over twice the frames"
            )
        })?;
    }
    ctx.undocumented(format!(
        "a stream left with a partial frame is held open with no timeout (checked for \
         {hold:?}); its bytes stay buffered in the broker, up to the frame limit per stream, \
         so one connection may hold FELIX_MAX_STREAMS_PER_CONNECTION x FELIX_MAX_FRAME_BYTES \
         (QUIC's windows do not bound it: the bytes leave QUIC for the frame buffer)"
    ));
    Ok(())
}

/// Makes every core export its counters (they are exported at the end of each input a core
/// handles): deleting a stream is applied by every core. Returns the gauges then.
async fn settled_gauges(
    ctx: &mut Ctx,
    addr: SocketAddr,
) -> Result<(Option<u64>, Option<u64>), String> {
    let name = ctx.unique_name("poke");
    ctx.create_stream(&name, 1).await?;
    ctx.admin()
        .delete_stream(&name)
        .await
        .map_err(|error| format!("delete {name}: {error}"))?;
    let body = metrics(addr).await?;
    Ok((
        gauge(&body, "felix_connections"),
        gauge(&body, "felix_subscribers"),
    ))
}

/// Polls `felix_connections` until it equals `expected` or `wait` passes; returns the last value.
async fn connections_become(
    addr: SocketAddr,
    expected: u64,
    wait: Duration,
) -> Result<Option<u64>, String> {
    let deadline = Instant::now() + wait;
    loop {
        let value = gauge(&metrics(addr).await?, "felix_connections");
        if value == Some(expected) || Instant::now() >= deadline {
            return Ok(value);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `felix_connections` counts a connection while it is open and stops counting it once it
/// closed, on a core that has nothing else to do meanwhile.
pub(crate) async fn connection_gauge_is_current(ctx: &mut Ctx) -> Result<(), String> {
    /// Time the gauge may take to catch up with a close: the broker learns of it within
    /// milliseconds on loopback.
    const CATCH_UP: Duration = Duration::from_secs(5);
    let Some(addr) = ctx.target().metrics_addr else {
        ctx.skip("no metrics address");
        return Ok(());
    };
    let (Some(before), _) = settled_gauges(ctx, addr).await? else {
        return Err("no felix_connections gauge".to_owned());
    };
    let core = *ctx.core_addrs().last().ok_or("no core address")?;
    let session = ctx.session_at(core).await?;
    let opened = connections_become(addr, before + 1, STEP).await?;
    ensure(opened == Some(before + 1), || {
        format!("felix_connections is {opened:?} with one connection more than {before}")
    })?;
    let mut session = session;
    session.conn.connection.close(0u32.into());
    let _ = session.conn.closed(STEP).await;
    drop(session);
    let closed = connections_become(addr, before, CATCH_UP).await?;
    // Put the gauges right for the cases after this one, whatever happened.
    let settled = settled_gauges(ctx, addr).await?;
    ensure(closed == Some(before), || {
        format!(
            "felix_connections still {closed:?} (not {before}) {CATCH_UP:?} after a connection \
             to core {}'s own port closed; after another input on every core it reads {:?}: \
             the decrement is exported only with a core's next input",
            ctx.core_addrs().len() - 1,
            settled.0
        )
    })
}

/// After every hostile client has gone (and every core exported its counters), the broker's
/// connection and subscriber gauges are back to the healthy client's own: one connection, no
/// subscription.
pub(crate) async fn nothing_leaked(ctx: &mut Ctx) -> Result<(), String> {
    let Some(addr) = ctx.target().metrics_addr else {
        ctx.skip("no metrics address");
        return Ok(());
    };
    let deadline = Instant::now() + STEP;
    loop {
        let (connections, subscribers) = settled_gauges(ctx, addr).await?;
        if connections == Some(1) && subscribers == Some(0) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "felix_connections {connections:?} (the healthy client's 1 expected), \
                 felix_subscribers {subscribers:?} (0 expected) {STEP:?} after the last case"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `GET /metrics` over plain TCP.
async fn metrics(addr: SocketAddr) -> Result<String, String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: felix\r\n\r\n")
            .await?;
        let mut body = String::new();
        stream.read_to_string(&mut body).await?;
        Ok::<String, std::io::Error>(body)
    };
    match tokio::time::timeout(STEP, fetch).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(error)) => Err(format!("GET /metrics: {error}")),
        Err(_) => Err("GET /metrics hung".to_owned()),
    }
}

/// The value of an unlabelled gauge line `name value`.
fn gauge(body: &str, name: &str) -> Option<u64> {
    body.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(' ')?;
        rest.trim().parse::<f64>().ok().map(|value| value as u64)
    })
}
