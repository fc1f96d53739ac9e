//! One stream of an engine: its kind, its shards and its subscriptions. Lives on the engine's
//! core.

use felix_wire::StreamKind;

use crate::EngineError;
use crate::shard::Shard;
use crate::subscription::Slot;

#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) kind: StreamKind,
    /// `shards.len()` is the shard count: at least 1, at most `EngineConfig::max_shards`.
    pub(crate) shards: Vec<Shard>,
    /// Every subscription of this stream, in the order they subscribed.
    pub(crate) subscriptions: Vec<Slot>,
    /// Catalogue id of a durable stream (every shard then has a `DurableShard`).
    pub(crate) stream_id: Option<u32>,
}

impl Stream {
    /// The shard count as carried on the wire. Creation bounds it by `max_shards: u32`.
    #[must_use]
    pub(crate) fn shard_count(&self) -> u32 {
        u32::try_from(self.shards.len()).expect("shard count was checked against a u32 bound")
    }

    /// Stops `slot`, covering `shards` of this stream, from receiving records.
    pub(crate) fn detach(&mut self, slot: Slot, shards: &[u32]) {
        for &shard in shards {
            let subscribers = &mut self.shards[shard as usize].subscribers;
            let before = subscribers.len();
            subscribers.retain(|subscriber| *subscriber != slot);
            assert_eq!(
                subscribers.len() + 1,
                before,
                "a subscription is listed once per shard"
            );
        }
        let before = self.subscriptions.len();
        self.subscriptions
            .retain(|subscription| *subscription != slot);
        assert_eq!(
            self.subscriptions.len() + 1,
            before,
            "a subscription is listed once"
        );
    }
}

/// Checks a stream name: 1..=`max_name_bytes` bytes of `[A-Za-z0-9._-]`.
pub(crate) fn check_name(name: &str, max_name_bytes: u16) -> Result<(), EngineError> {
    let valid_chars = name
        .bytes()
        .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'));
    if name.is_empty() || name.len() > usize::from(max_name_bytes) || !valid_chars {
        return Err(EngineError::invalid(format!(
            "invalid stream name {name:?}: a name is 1 to {max_name_bytes} bytes of \
             [A-Za-z0-9._-]"
        )));
    }
    Ok(())
}
