//! Which calls are retries: the recovery budget is for them, so a caller must not be able to
//! claim it by saying so.
//!
//! What names one call across its attempts is its [`CallId`]. An AWS SDK retry repeats its call's
//! `amz-sdk-invocation-id` and says `amz-sdk-request: attempt=N` with N > 1. The OpenAI and
//! Anthropic SDKs send no id; they say `x-stainless-retry-count: N` with N > 0 and repeat the
//! request body byte for byte, so the body names the call. Either way it is the client's word. A
//! call counts as a retry only if, in addition, this proxy answered the same call, for the same
//! route, with a rejection (429 or 5xx) within the last [`WINDOW`]. Each rejection vouches for one
//! retry: the entry is taken when the retry uses it (a retry turned away again is recorded again).
//! Two callers of one route sending the same body share entries, but never more retries than
//! rejections.
//!
//! Memory is bounded: at most [`CAPACITY`] rejections are remembered (16,384 entries of a 64-bit
//! keyed hash and an instant, under 1 MiB; a body is hashed, never kept), the oldest forgotten
//! first, and none longer than [`WINDOW`] (120 s: longer than any SDK's backoff plus the largest
//! retry hint, 20 s for the Rust SDK). Keys are SipHash with a per-process random key, so a
//! client cannot aim collisions at another route's entries. When more than [`CAPACITY`]
//! rejections arrive within the window, the oldest retries are treated as first attempts: they
//! lose the reserve, nothing else.

use std::{
    collections::{HashMap, VecDeque},
    hash::{BuildHasher, RandomState},
    sync::Mutex,
    time::{Duration, Instant},
};

use bytes::Bytes;

/// How many rejections are remembered at most.
pub const CAPACITY: usize = 16_384;
/// How long a rejection vouches for a retry.
pub const WINDOW: Duration = Duration::from_secs(120);
/// Longer invocation ids are not SDK ids (those are UUIDs, 36 characters): never remembered.
const MAX_ID_LEN: usize = 64;

/// What names one call across its SDK's attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallId {
    /// The AWS SDKs' `amz-sdk-invocation-id`.
    Invocation(String),
    /// The request body, for SDKs that send no id but repeat the body on every attempt (a
    /// reference-counted handle on the bytes read, not a copy).
    Body(Bytes),
}

/// The rejections this proxy answered recently, by route and call.
#[derive(Debug)]
pub struct RecentRejections {
    hasher: RandomState,
    capacity: usize,
    window: Duration,
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    /// Key -> when it was (last) rejected.
    at: HashMap<u64, Instant>,
    /// Keys in the order they were recorded (a key recorded twice appears twice; only the entry
    /// matching `at` counts).
    order: VecDeque<(u64, Instant)>,
}

impl Default for RecentRejections {
    fn default() -> Self {
        RecentRejections::new(CAPACITY, WINDOW)
    }
}

impl RecentRejections {
    pub fn new(capacity: usize, window: Duration) -> RecentRejections {
        RecentRejections {
            hasher: RandomState::new(),
            capacity: capacity.max(1),
            window,
            inner: Mutex::new(Entries::default()),
        }
    }

    /// Remembers that `route`'s call `call` was answered with a rejection at `now`.
    pub fn record(&self, route: &str, call: &CallId, now: Instant) {
        let Some(key) = self.key(route, call) else {
            return;
        };
        let mut entries = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        entries.forget_older_than(now, self.window);
        while entries.order.len() >= self.capacity {
            entries.pop_oldest();
        }
        entries.at.insert(key, now);
        entries.order.push_back((key, now));
    }

    /// Whether `route`'s call `call` was rejected within the window; if so the entry is used up.
    pub fn take(&self, route: &str, call: &CallId, now: Instant) -> bool {
        let Some(key) = self.key(route, call) else {
            return false;
        };
        let mut entries = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        entries.forget_older_than(now, self.window);
        entries.at.remove(&key).is_some()
    }

    /// How many rejections are remembered now.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .at
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn key(&self, route: &str, call: &CallId) -> Option<u64> {
        // The separator cannot occur in a route name, so (route, id) pairs never collide by
        // concatenation; the tag keeps an id and a body of the same bytes apart.
        match call {
            CallId::Invocation(id) => (!id.is_empty() && id.len() <= MAX_ID_LEN)
                .then(|| self.hasher.hash_one((route, '\n', 0u8, id.as_str()))),
            CallId::Body(body) => {
                (!body.is_empty()).then(|| self.hasher.hash_one((route, '\n', 1u8, &body[..])))
            }
        }
    }
}

impl Entries {
    fn forget_older_than(&mut self, now: Instant, window: Duration) {
        while let Some(&(_, at)) = self.order.front() {
            if now.saturating_duration_since(at) <= window {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((key, at)) = self.order.pop_front()
            && self.at.get(&key) == Some(&at)
        {
            self.at.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(id: &str) -> CallId {
        CallId::Invocation(id.to_owned())
    }

    #[test]
    fn a_rejection_vouches_for_one_retry_of_the_same_route_and_call() {
        let recent = RecentRejections::default();
        let t0 = Instant::now();
        assert!(!recent.take("app", &id("id-1"), t0), "never rejected");
        recent.record("app", &id("id-1"), t0);
        assert!(
            !recent.take("other", &id("id-1"), t0),
            "another route's call"
        );
        assert!(!recent.take("app", &id("id-2"), t0), "another call");
        assert!(recent.take("app", &id("id-1"), t0 + Duration::from_secs(3)));
        assert!(
            !recent.take("app", &id("id-1"), t0 + Duration::from_secs(4)),
            "used up"
        );
        recent.record("app", &id("id-1"), t0 + Duration::from_secs(5));
        assert!(recent.take("app", &id("id-1"), t0 + Duration::from_secs(6)));
    }

    #[test]
    fn rejections_expire_after_the_window() {
        let recent = RecentRejections::new(8, Duration::from_secs(10));
        let t0 = Instant::now();
        recent.record("app", &id("old"), t0);
        recent.record("app", &id("new"), t0 + Duration::from_secs(8));
        let later = t0 + Duration::from_secs(11);
        assert!(!recent.take("app", &id("old"), later));
        assert!(recent.take("app", &id("new"), later));
        assert!(recent.is_empty());
    }

    #[test]
    fn memory_stays_within_capacity_and_forgets_the_oldest() {
        let recent = RecentRejections::new(4, Duration::from_secs(60));
        let t0 = Instant::now();
        for i in 0..10 {
            recent.record("app", &id(&format!("id-{i}")), t0);
        }
        assert_eq!(recent.len(), 4);
        assert!(!recent.take("app", &id("id-5"), t0));
        assert!(recent.take("app", &id("id-6"), t0));
        // The same call rejected again and again holds one entry, and the queue stays bounded.
        for _ in 0..100 {
            recent.record("app", &id("again"), t0);
        }
        assert!(recent.len() <= 4);
        assert!(recent.inner.lock().unwrap().order.len() <= 4);
        assert!(recent.take("app", &id("again"), t0));
    }

    #[test]
    fn ids_that_are_no_sdk_ids_are_never_remembered() {
        let recent = RecentRejections::default();
        let t0 = Instant::now();
        let long = "x".repeat(65);
        recent.record("app", &id(&long), t0);
        recent.record("app", &id(""), t0);
        recent.record("app", &CallId::Body(Bytes::new()), t0);
        assert!(recent.is_empty());
    }

    #[test]
    fn a_body_names_its_call_apart_from_an_id_of_the_same_bytes() {
        let recent = RecentRejections::default();
        let t0 = Instant::now();
        let body = CallId::Body(Bytes::from_static(b"{\"model\":\"m\"}"));
        recent.record("app", &body, t0);
        assert!(!recent.take("app", &id("{\"model\":\"m\"}"), t0));
        assert!(!recent.take("app", &CallId::Body(Bytes::from_static(b"{}")), t0));
        assert!(!recent.take("other", &body, t0));
        let again = CallId::Body(Bytes::copy_from_slice(b"{\"model\":\"m\"}"));
        assert!(recent.take("app", &again, t0), "the same bytes, read again");
        assert!(!recent.take("app", &again, t0), "used up");
    }
}
