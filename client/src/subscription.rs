//! A subscription stream: one `Subscribe`, then `Delivery` frames, exposed as a
//! `futures::Stream` of records. Polled by whoever holds it; no task of its own.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use felix_wire::{Decoder, DeliveredRecord, Frame};
use s2n_quic::stream::{ReceiveStream, SendStream};

use crate::{ClientError, describe_stream_error, read_frame};

/// QUIC application code used to stop a subscription: 0, "normal close".
const STOP_CODE: u32 = 0;

/// One subscription stream on one connection.
pub(crate) struct SubscriptionPart {
    receive: ReceiveStream,
    send: SendStream,
    decoder: Decoder,
    buffer: BytesMut,
    ready: VecDeque<DeliveredRecord>,
    start: Vec<(u32, u64)>,
    done: bool,
}

impl std::fmt::Debug for SubscriptionPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriptionPart")
            .field("start", &self.start)
            .field("buffered", &self.ready.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl SubscriptionPart {
    /// Sends `subscribe` and waits for `Subscribed` (or the broker's `Error`).
    pub(crate) async fn open(
        mut receive: ReceiveStream,
        mut send: SendStream,
        decoder: Decoder,
        subscribe: &Frame,
    ) -> Result<SubscriptionPart, ClientError> {
        let mut out = BytesMut::new();
        felix_wire::encode(subscribe, &mut out);
        send.send(out.freeze())
            .await
            .map_err(|error| ClientError::Closed(describe_stream_error(&error)))?;
        let mut buffer = BytesMut::new();
        match read_frame(&decoder, &mut receive, &mut buffer).await? {
            Frame::Subscribed(subscribed) => Ok(SubscriptionPart {
                receive,
                send,
                decoder,
                buffer,
                ready: VecDeque::new(),
                start: subscribed.shards,
                done: false,
            }),
            Frame::Error(error) => Err(ClientError::from_error_frame(error)),
            other => Err(ClientError::Protocol(format!(
                "expected Subscribed, got {other:?}"
            ))),
        }
    }

    fn stop(&mut self) {
        if !self.done {
            self.done = true;
            // Either may fail if the stream is already gone; that is the goal anyway.
            let _ = self.receive.stop_sending(STOP_CODE.into());
            let _ = self.send.reset(STOP_CODE.into());
        }
    }
}

impl Drop for SubscriptionPart {
    fn drop(&mut self) {
        self.stop();
    }
}

impl futures::Stream for SubscriptionPart {
    type Item = Result<DeliveredRecord, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(record) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(record)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.decoder.decode(&mut this.buffer) {
                Ok(Some(Frame::Delivery(delivery))) => {
                    this.ready.extend(delivery.records);
                    continue;
                }
                Ok(Some(Frame::Error(error))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(ClientError::from_error_frame(error))));
                }
                Ok(Some(other)) => {
                    this.stop();
                    return Poll::Ready(Some(Err(ClientError::Protocol(format!(
                        "unexpected frame on a subscription: {other:?}"
                    )))));
                }
                Ok(None) => {}
                Err(error) => {
                    this.stop();
                    return Poll::Ready(Some(Err(ClientError::Protocol(format!(
                        "undecodable frame from the broker: {error}"
                    )))));
                }
            }
            match this.receive.poll_receive(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(Some(chunk))) => this.buffer.extend_from_slice(&chunk),
                Poll::Ready(Ok(None)) => {
                    this.done = true;
                    if !this.buffer.is_empty() {
                        return Poll::Ready(Some(Err(ClientError::Protocol(
                            "the subscription ended inside a frame".to_owned(),
                        ))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Ready(Err(error)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(stream_error(&error))));
                }
            }
        }
    }
}

/// Records of one subscription, in per-shard order: one part per owner core (core-aware) or a
/// single part, merged. Ends (`None`) when the broker finishes every part; yields one `Err`
/// (e.g. `SubscriberLagged`, `StreamNotFound`) and ends when the broker ends any part with an
/// error. Dropping it (or [`Subscription::close`]) stops every part.
pub struct Subscription {
    parts: Vec<SubscriptionPart>,
    start: Vec<(u32, u64)>,
    /// Part polled first next time, so no part starves the others.
    next: usize,
    done: bool,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("start", &self.start)
            .field("parts", &self.parts.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Subscription {
    pub(crate) fn merged(parts: Vec<SubscriptionPart>) -> Subscription {
        let mut start: Vec<(u32, u64)> = parts
            .iter()
            .flat_map(|part| part.start.iter().copied())
            .collect();
        start.sort_unstable_by_key(|(shard, _)| *shard);
        Subscription {
            parts,
            start,
            next: 0,
            done: false,
        }
    }

    /// `(shard, first offset delivered)` for every subscribed shard, ascending shard order.
    #[must_use]
    pub fn start(&self) -> &[(u32, u64)] {
        &self.start
    }

    /// Stops the subscription: the broker forgets it and frees its queues.
    pub async fn close(mut self) {
        for part in &mut self.parts {
            part.stop();
        }
    }
}

impl futures::Stream for Subscription {
    type Item = Result<DeliveredRecord, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let count = this.parts.len();
        let mut finished = 0;
        for step in 0..count {
            let index = (this.next + step) % count;
            match Pin::new(&mut this.parts[index]).poll_next(cx) {
                Poll::Ready(Some(Ok(record))) => {
                    this.next = (index + 1) % count;
                    return Poll::Ready(Some(Ok(record)));
                }
                Poll::Ready(Some(Err(error))) => {
                    this.done = true;
                    for part in &mut this.parts {
                        part.stop();
                    }
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Ready(None) => finished += 1,
                Poll::Pending => {}
            }
        }
        if finished == count {
            this.done = true;
            return Poll::Ready(None);
        }
        Poll::Pending
    }
}

/// A subscription stream's QUIC error: a reset carrying a Felix error code (a stalled
/// subscriber whose subscription ended, docs/wire-protocol.md section 10) is that error,
/// anything else a closed stream.
fn stream_error(error: &s2n_quic::stream::Error) -> ClientError {
    if let s2n_quic::stream::Error::StreamReset { error: code, .. } = error
        && let Some(code) = u16::try_from(**code)
            .ok()
            .and_then(felix_wire::ErrorCode::from_u16)
    {
        return ClientError::Server {
            code,
            detail: 0,
            message: format!(
                "the broker reset the subscription stream with {} while the client was not \
                 reading; resume from the offset after the last record received of each shard",
                code.name()
            ),
        };
    }
    ClientError::Closed(describe_stream_error(error))
}
