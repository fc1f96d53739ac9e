//! Who a connection is and what it may do (docs/security.md): the security settings every
//! core shares (authentication mode, the authorization policy, the per-connection limits),
//! the per-principal connection ledger, and the names of the limits and refusals the
//! counters are kept by.
//!
//! Threads: one [`Security`] is built at start-up and shared read-only by every core (an
//! `Arc`); its [`PrincipalLedger`] is the one piece of state cores share, behind a mutex
//! taken once when a connection's handshake is accepted and once when it closes, never per
//! request or record.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use felix_auth::{Operation, Policy, Principal};
use felix_wire::WireError;

/// The per-connection limits (each a FELIX_* setting, docs/configuration.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections on one core (FELIX_MAX_CONNECTIONS_PER_CORE).
    pub connections_per_core: u32,
    /// Open connections of one principal over every core; 0 = no limit
    /// (FELIX_MAX_CONNECTIONS_PER_PRINCIPAL).
    pub connections_per_principal: u32,
    /// Client-opened streams open at once on one connection
    /// (FELIX_MAX_STREAMS_PER_CONNECTION).
    pub streams_per_connection: u32,
    /// Subscriptions open at once on one connection (FELIX_MAX_SUBSCRIPTIONS_PER_CONNECTION).
    pub subscriptions_per_connection: u32,
}

impl ConnectionLimits {
    /// The settings' defaults (docs/configuration.md).
    pub const DEFAULT: ConnectionLimits = ConnectionLimits {
        connections_per_core: 10_000,
        connections_per_principal: 1024,
        streams_per_connection: 256,
        subscriptions_per_connection: 64,
    };
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits::DEFAULT
    }
}

/// What every core enforces: built once, shared by all cores.
#[derive(Debug)]
pub struct Security {
    /// FELIX_AUTH=required: a Hello without a valid credential is refused.
    pub auth_required: bool,
    /// FELIX_RULES, compiled; open when there are none.
    pub policy: Policy,
    pub limits: ConnectionLimits,
    ledger: PrincipalLedger,
}

impl Security {
    #[must_use]
    pub fn new(auth_required: bool, policy: Policy, limits: ConnectionLimits) -> Security {
        Security {
            auth_required,
            policy,
            limits,
            ledger: PrincipalLedger::default(),
        }
    }

    /// The development default: no credential needed, no rules, default limits.
    #[must_use]
    pub fn open() -> Security {
        Security::new(false, Policy::open(), ConnectionLimits::DEFAULT)
    }

    /// Counts one more connection of `principal`, unless it already holds
    /// `connections_per_principal` (then `Err` with that limit).
    pub(crate) fn acquire(&self, principal: &Principal) -> Result<(), u32> {
        self.ledger
            .acquire(principal, self.limits.connections_per_principal)
    }

    /// One connection of `principal` fewer (it was counted by [`Security::acquire`]).
    pub(crate) fn release(&self, principal: &Principal) {
        self.ledger.release(principal);
    }

    /// Open connections of `principal` over every core.
    #[must_use]
    pub fn connections_of(&self, principal: &Principal) -> u32 {
        self.ledger.count(principal)
    }
}

/// Open connections per principal, over every core. Bounded by the connections that exist:
/// an entry leaves when its count reaches 0.
#[derive(Debug, Default)]
struct PrincipalLedger {
    counts: Mutex<HashMap<Principal, u32>>,
}

impl PrincipalLedger {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Principal, u32>> {
        // Each operation is one insert or update: a panic while holding the lock cannot leave
        // the map half-changed, so a poisoned lock is still usable.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn acquire(&self, principal: &Principal, max: u32) -> Result<(), u32> {
        let mut counts = self.counts();
        let count = counts.entry(principal.clone()).or_insert(0);
        if max > 0 && *count >= max {
            if *count == 0 {
                counts.remove(principal);
            }
            return Err(max);
        }
        *count += 1;
        Ok(())
    }

    fn release(&self, principal: &Principal) {
        let mut counts = self.counts();
        let count = counts
            .get_mut(principal)
            .expect("a released principal was acquired");
        assert!(*count > 0, "a principal's count covers its connections");
        *count -= 1;
        if *count == 0 {
            counts.remove(principal);
        }
    }

    fn count(&self, principal: &Principal) -> u32 {
        self.counts().get(principal).copied().unwrap_or(0)
    }
}

/// A limit a client can run into; counted per core by kind (`felix_limit_exceeded_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    ConnectionsPerCore,
    ConnectionsPerPrincipal,
    StreamsPerConnection,
    SubscriptionsPerConnection,
    Streams,
    ShardsPerStream,
    HelloBytes,
    HelloTime,
    FrameBytes,
    BatchRecords,
    KeyBytes,
    PayloadBytes,
    NameBytes,
    /// Any other list count of a frame (shard lists, ...).
    ListItems,
}

impl Limit {
    pub const ALL: [Limit; 14] = [
        Limit::ConnectionsPerCore,
        Limit::ConnectionsPerPrincipal,
        Limit::StreamsPerConnection,
        Limit::SubscriptionsPerConnection,
        Limit::Streams,
        Limit::ShardsPerStream,
        Limit::HelloBytes,
        Limit::HelloTime,
        Limit::FrameBytes,
        Limit::BatchRecords,
        Limit::KeyBytes,
        Limit::PayloadBytes,
        Limit::NameBytes,
        Limit::ListItems,
    ];

    /// Stable snake_case name (metrics label).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Limit::ConnectionsPerCore => "connections_per_core",
            Limit::ConnectionsPerPrincipal => "connections_per_principal",
            Limit::StreamsPerConnection => "streams_per_connection",
            Limit::SubscriptionsPerConnection => "subscriptions_per_connection",
            Limit::Streams => "streams",
            Limit::ShardsPerStream => "shards_per_stream",
            Limit::HelloBytes => "hello_bytes",
            Limit::HelloTime => "hello_time",
            Limit::FrameBytes => "frame_bytes",
            Limit::BatchRecords => "batch_records",
            Limit::KeyBytes => "key_bytes",
            Limit::PayloadBytes => "payload_bytes",
            Limit::NameBytes => "name_bytes",
            Limit::ListItems => "list_items",
        }
    }

    pub(crate) fn index(self) -> usize {
        // ALL lists every variant in declaration order.
        self as usize
    }

    /// The limit a frame-decoding error ran into, if it is one (`hello`: on the hello
    /// stream, where the frame bound is FELIX_HELLO_MAX_BYTES).
    #[must_use]
    pub fn of_wire_error(error: &WireError, hello: bool) -> Option<Limit> {
        match error {
            WireError::FrameTooLarge { .. } if hello => Some(Limit::HelloBytes),
            WireError::FrameTooLarge { .. } => Some(Limit::FrameBytes),
            WireError::LimitExceeded { what, .. } => Some(match *what {
                "record count" => Limit::BatchRecords,
                "key length" => Limit::KeyBytes,
                "payload length" => Limit::PayloadBytes,
                "stream name length" => Limit::NameBytes,
                _ => Limit::ListItems,
            }),
            WireError::Malformed { .. } | WireError::UnknownFrameType(_) => None,
        }
    }
}

const _: () = assert!(Limit::ALL.len() == Limit::ListItems as usize + 1);

/// Why a handshake was refused with `Unauthenticated` (`felix_auth_refused_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthRefusal {
    /// FELIX_AUTH=required and no certificate or token was presented.
    Missing,
    /// The token does not have the `felix_<id>_<secret>` shape.
    Malformed,
    /// No token with that id in the tokens file.
    Unknown,
    /// The token's id is known, its secret is not the one stored.
    Wrong,
    /// The token was removed from the tokens file (SIGHUP) while its connection was open.
    Revoked,
}

impl AuthRefusal {
    pub const ALL: [AuthRefusal; 5] = [
        AuthRefusal::Missing,
        AuthRefusal::Malformed,
        AuthRefusal::Unknown,
        AuthRefusal::Wrong,
        AuthRefusal::Revoked,
    ];

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            AuthRefusal::Missing => "missing",
            AuthRefusal::Malformed => "malformed",
            AuthRefusal::Unknown => "unknown",
            AuthRefusal::Wrong => "wrong",
            AuthRefusal::Revoked => "revoked",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn of_token(refusal: &felix_auth::TokenRefusal) -> AuthRefusal {
        match refusal {
            felix_auth::TokenRefusal::Malformed => AuthRefusal::Malformed,
            felix_auth::TokenRefusal::Unknown => AuthRefusal::Unknown,
            felix_auth::TokenRefusal::Wrong => AuthRefusal::Wrong,
        }
    }
}

const _: () = assert!(AuthRefusal::ALL.len() == AuthRefusal::Revoked as usize + 1);

/// The operations authorization is counted by, in `felix_permission_denied_total` order.
pub const OPERATIONS: [Operation; 6] = [
    Operation::Publish,
    Operation::Subscribe,
    Operation::Create,
    Operation::Delete,
    Operation::Describe,
    Operation::List,
];

pub(crate) fn operation_index(operation: Operation) -> usize {
    match operation {
        Operation::Publish => 0,
        Operation::Subscribe => 1,
        Operation::Create => 2,
        Operation::Delete => 3,
        Operation::Describe => 4,
        Operation::List => 5,
    }
}

/// A token the shell must check ([`crate::Core::poll_token_check`]); answer it with
/// [`crate::Core::handle_token_checked`].
#[derive(Clone, PartialEq, Eq)]
pub struct TokenCheck {
    /// The hello stream waiting for the answer.
    pub stream: crate::StreamId,
    pub token: bytes::Bytes,
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("TokenCheck")
            .field("stream", &self.stream)
            .field("token_bytes", &self.token.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The ledger counts each principal over all cores, refuses at the limit (0 = none) and
    // forgets principals with no connection left.
    #[test]
    fn the_ledger_counts_and_refuses_at_the_limit() {
        let ledger = PrincipalLedger::default();
        let alice = Principal::new("alice").expect("a principal");
        assert_eq!(ledger.acquire(&alice, 2), Ok(()));
        assert_eq!(ledger.acquire(&alice, 2), Ok(()));
        assert_eq!(ledger.acquire(&alice, 2), Err(2));
        assert_eq!(ledger.count(&alice), 2);
        ledger.release(&alice);
        assert_eq!(ledger.acquire(&alice, 2), Ok(()));
        ledger.release(&alice);
        ledger.release(&alice);
        assert_eq!(ledger.count(&alice), 0);
        assert!(ledger.counts().is_empty(), "no entry without a connection");
        for _ in 0..5 {
            assert_eq!(ledger.acquire(&alice, 0), Ok(()), "0 is no limit");
        }
    }

    // Every decoder limit maps to its counter, the frame bound on the hello stream to
    // hello_bytes.
    #[test]
    fn wire_errors_map_to_limits() {
        let over = |what| WireError::LimitExceeded {
            what,
            value: 2,
            max: 1,
        };
        let too_large = WireError::FrameTooLarge { len: 2, max: 1 };
        assert_eq!(
            Limit::of_wire_error(&too_large, true),
            Some(Limit::HelloBytes)
        );
        assert_eq!(
            Limit::of_wire_error(&too_large, false),
            Some(Limit::FrameBytes)
        );
        assert_eq!(
            Limit::of_wire_error(&over("record count"), false),
            Some(Limit::BatchRecords)
        );
        assert_eq!(
            Limit::of_wire_error(&over("key length"), false),
            Some(Limit::KeyBytes)
        );
        assert_eq!(
            Limit::of_wire_error(&over("payload length"), false),
            Some(Limit::PayloadBytes)
        );
        assert_eq!(
            Limit::of_wire_error(&over("shard count"), false),
            Some(Limit::ListItems)
        );
        for (index, limit) in Limit::ALL.iter().enumerate() {
            assert_eq!(limit.index(), index);
        }
        for (index, refusal) in AuthRefusal::ALL.iter().enumerate() {
            assert_eq!(refusal.index(), index);
        }
        for (index, operation) in OPERATIONS.iter().enumerate() {
            assert_eq!(operation_index(*operation), index);
        }
    }
}
