//! The streams of an engine: each stream's kind, shards and subscriptions, and the table that
//! holds them (a slab addressed by handle, catalogue id or subscription, plus a name index).
//! Lives on the engine's core.

use std::collections::HashMap;

use felix_wire::StreamKind;

use crate::shard::Shard;
use crate::subscription::Slot;
use crate::{EngineError, StreamHandle};

#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) name: Box<str>,
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

/// Index of a stream in the engine's [`StreamTable`]. Slots are reused after a delete; a
/// [`StreamHandle`] pairs one with its generation so a reused slot is told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamSlot(u32);

impl StreamSlot {
    fn index(self) -> usize {
        // u32 -> usize is lossless on every target Felix builds for (64-bit).
        self.0 as usize
    }
}

/// One slot of the table.
#[derive(Debug)]
struct StreamEntry {
    /// Bumped each time the slot's stream is deleted, so handles to it go stale.
    generation: u32,
    stream: Option<Stream>,
}

/// Every stream of an engine: a slab, so a handle, a catalogue id or a subscription reaches
/// its stream by index without hashing the name, plus the name -> slot index for the calls
/// that name a stream.
#[derive(Debug, Default)]
pub(crate) struct StreamTable {
    entries: Vec<StreamEntry>,
    /// Empty slots that may be reused (a slot whose generation ran out is never reused).
    free: Vec<StreamSlot>,
    names: HashMap<Box<str>, StreamSlot>,
}

impl StreamTable {
    /// The slot of the stream called `name`; one hash lookup.
    #[must_use]
    pub(crate) fn slot_of(&self, name: &str) -> Option<StreamSlot> {
        self.names.get(name).copied()
    }

    /// Streams held.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether a stream called `name` exists.
    #[must_use]
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// The handle of the stream in `slot` (which must hold one).
    #[must_use]
    pub(crate) fn handle(&self, slot: StreamSlot) -> StreamHandle {
        let entry = &self.entries[slot.index()];
        assert!(entry.stream.is_some(), "handles name live streams");
        StreamHandle {
            slot: slot.0,
            generation: entry.generation,
        }
    }

    /// The slot `handle` names if its stream still exists; `None` for a stale handle (its
    /// stream was deleted, whatever the slot holds now) or one of another engine beyond the
    /// slab.
    #[must_use]
    pub(crate) fn resolve(&self, handle: StreamHandle) -> Option<StreamSlot> {
        let slot = StreamSlot(handle.slot);
        let entry = self.entries.get(slot.index())?;
        (entry.generation == handle.generation && entry.stream.is_some()).then_some(slot)
    }

    /// The stream in `slot`. Slots come from a handle just resolved, a catalogue id or a live
    /// subscription, all of which name live streams, so an empty slot is an engine defect.
    #[must_use]
    pub(crate) fn get(&self, slot: StreamSlot) -> &Stream {
        self.entries[slot.index()]
            .stream
            .as_ref()
            .expect("a stream slot in use holds its stream")
    }

    /// The stream in `slot`, mutably (see [`StreamTable::get`]).
    #[must_use]
    pub(crate) fn get_mut(&mut self, slot: StreamSlot) -> &mut Stream {
        self.entries[slot.index()]
            .stream
            .as_mut()
            .expect("a stream slot in use holds its stream")
    }

    /// The stream called `name`.
    #[must_use]
    pub(crate) fn by_name(&self, name: &str) -> Option<&Stream> {
        self.slot_of(name).map(|slot| self.get(slot))
    }

    /// Stores a new stream (its name must be free) and returns its slot.
    pub(crate) fn insert(&mut self, stream: Stream) -> StreamSlot {
        assert!(!self.contains(&stream.name), "stream names are unique");
        let name = stream.name.clone();
        let slot = match self.free.pop() {
            Some(slot) => {
                let entry = &mut self.entries[slot.index()];
                assert!(entry.stream.is_none(), "free slots are empty");
                entry.stream = Some(stream);
                slot
            }
            None => {
                // More than 2^32 streams on one core would exhaust memory long before.
                let slot =
                    StreamSlot(u32::try_from(self.entries.len()).expect("fewer than 2^32 slots"));
                self.entries.push(StreamEntry {
                    generation: 0,
                    stream: Some(stream),
                });
                slot
            }
        };
        self.names.insert(name, slot);
        slot
    }

    /// Takes the stream called `name` out of the table; its handles go stale.
    pub(crate) fn remove(&mut self, name: &str) -> Option<(StreamSlot, Stream)> {
        let slot = self.names.remove(name)?;
        let entry = &mut self.entries[slot.index()];
        let stream = entry
            .stream
            .take()
            .expect("the name index names occupied slots");
        // A slot whose generation would wrap is retired rather than reused, so no handle ever
        // becomes valid again (one empty entry per 2^32 deletes of a slot).
        if let Some(generation) = entry.generation.checked_add(1) {
            entry.generation = generation;
            self.free.push(slot);
        }
        Some((slot, stream))
    }

    /// Every stream with its slot, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (StreamSlot, &Stream)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(index, entry)| {
                let slot = StreamSlot(u32::try_from(index).expect("fewer than 2^32 slots"));
                entry.stream.as_ref().map(|stream| (slot, stream))
            })
    }

    /// Checks that the slab, the free list and the name index agree.
    pub(crate) fn assert_invariants(&self) {
        assert_eq!(
            self.iter().count(),
            self.names.len(),
            "slab and names agree"
        );
        for (slot, stream) in self.iter() {
            assert_eq!(
                self.names.get(&stream.name),
                Some(&slot),
                "the name index names the stream's slot"
            );
        }
        for slot in &self.free {
            assert!(
                self.entries[slot.index()].stream.is_none(),
                "free slots are empty"
            );
        }
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
