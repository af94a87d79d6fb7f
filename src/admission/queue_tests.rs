//! The queue's order, its bounded bypass, and leaving it, against the real memory ledger on
//! tokio's paused clock.

use std::sync::{Arc, Mutex};

use super::*;
use crate::ledger::{Clock, Limits, MemoryLedger};

fn class(priority: i32, route: &str) -> WaiterClass {
    WaiterClass {
        priority,
        route: Arc::from(route),
        demand: None,
    }
}

fn waiter(
    state: &mut State,
    class: &WaiterClass,
    tokens: u64,
) -> (u64, oneshot::Receiver<Reservation>) {
    let (tx, rx) = oneshot::channel();
    state.next_id += 1;
    let id = state.next_id;
    state.push(
        class,
        Waiter {
            id,
            tokens,
            route: class.route.clone(),
            demand: None,
            enqueued: Instant::now(),
            bypassed: 0,
            tx,
        },
    );
    (id, rx)
}

#[tokio::test]
async fn priority_first_then_routes_take_turns_then_fifo() {
    let mut state = State::default();
    let mut keep = Vec::new();
    let mut ids = std::collections::HashMap::new();
    for (name, prio, route) in [
        ("a1", 0, "a"),
        ("a2", 0, "a"),
        ("b1", 0, "b"),
        ("a3", 0, "a"),
        ("c1", 5, "c"),
        ("b2", 0, "b"),
    ] {
        let (id, rx) = waiter(&mut state, &class(prio, route), 1);
        ids.insert(id, name);
        keep.push(rx);
    }
    let order = |state: &State| state.in_order().map(|w| ids[&w.id]).collect::<Vec<_>>();
    assert_eq!(order(&state), ["c1", "a1", "b1", "a2", "b2", "a3"]);
    // Admitting heads one at a time: routes alternate.
    let mut admitted = Vec::new();
    while let Some(id) = state.head().map(|w| w.id) {
        admitted.push(ids[&id]);
        state.remove(id);
    }
    assert_eq!(admitted, ["c1", "a1", "b1", "a2", "b2", "a3"]);
    assert_eq!((state.len, state.queued_tokens), (0, 0));
}

#[tokio::test]
async fn removing_a_waiter_behind_the_head_keeps_every_turn() {
    let mut state = State::default();
    let (a1, _r1) = waiter(&mut state, &class(0, "a"), 1);
    let (b1, _r2) = waiter(&mut state, &class(0, "b"), 1);
    let (_a2, _r3) = waiter(&mut state, &class(0, "a"), 1);
    state.remove(b1);
    assert_eq!(state.head().map(|w| w.id), Some(a1), "a keeps its turn");
    assert_eq!(state.len, 2);
}

const LIMITS: Limits = Limits {
    tokens_per_minute: 60_000,
    requests_per_minute: None,
    max_concurrency: 100,
    tokens_per_day: None,
};

/// Empties the bucket; returns eight holders of 500 tokens each to release later.
async fn drained(ledger: &MemoryLedger) -> Vec<Reservation> {
    let take = |tokens| async move {
        match ledger
            .reserve(&ReserveRequest {
                pool: "p",
                limits: LIMITS,
                tokens,
                share: None,
                hold_back: 0,
            })
            .await
        {
            Ok(Verdict::Granted(r)) => r,
            other => panic!("setup reserve failed: {other:?}"),
        }
    };
    let drain = take(56_000).await;
    let mut holders = Vec::new();
    for _ in 0..8 {
        holders.push(take(500).await);
    }
    ledger.settle(drain, 56_000).await.unwrap();
    holders
}

#[tokio::test(start_paused = true)]
async fn a_large_head_is_passed_by_at_most_max_bypass_small_ones() {
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let holders = drained(&ledger).await;
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(30), 100));
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, tokens) in
        std::iter::once(("L".to_string(), 3_000)).chain((1..=8).map(|i| (format!("S{i}"), 100)))
    {
        let ticket = queue
            .enqueue(&WaiterClass::default(), tokens, ledger.clone())
            .unwrap();
        let (order, ledger) = (order.clone(), ledger.clone());
        tasks.push(tokio::spawn(async move {
            let r = ticket
                .wait(Instant::now() + Duration::from_secs(30))
                .await
                .unwrap();
            order.lock().unwrap().push(name);
            ledger.settle(r, tokens).await.unwrap();
        }));
    }
    let dispatcher = tokio::spawn(
        queue
            .clone()
            .dispatch(ledger.clone(), Arc::from("p"), || (LIMITS, 0)),
    );
    // Each released holder frees 500 tokens: room for small ones, not for L (3,000).
    for holder in holders {
        ledger.settle(holder, 0).await.unwrap();
        queue.wake();
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order[..5],
        ["S1", "S2", "S3", "S4", "L"],
        "four bypasses, then the head: {order:?}"
    );
    assert_eq!(order.len(), 9);
    queue.close();
    dispatcher.await.unwrap();
    let snapshot = ledger.snapshot("p", &LIMITS).await.unwrap();
    assert_eq!(
        (snapshot.reserved_tokens, snapshot.in_flight_requests),
        (0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn the_head_is_admitted_when_refill_covers_it_never_before() {
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let holders = drained(&ledger).await;
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(30), 100));
    let ticket = queue
        .enqueue(&WaiterClass::default(), 2_000, ledger.clone())
        .unwrap();
    let dispatcher = tokio::spawn(
        queue
            .clone()
            .dispatch(ledger.clone(), Arc::from("p"), || (LIMITS, 0)),
    );
    let start = Instant::now();
    let r = ticket.wait(start + Duration::from_secs(30)).await.unwrap();
    // 2,000 tokens at 1,000 per second, refilling from the end of the 100 ms transit hold that
    // draining the full bucket started.
    assert_eq!(start.elapsed(), Duration::from_millis(2_100));
    ledger.settle(r, 0).await.unwrap();
    for h in holders {
        ledger.settle(h, 0).await.unwrap();
    }
    queue.close();
    dispatcher.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn leaving_the_queue_holds_nothing_even_when_admitted_at_that_instant() {
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(30), 100));
    // Plain leave: dropped while waiting.
    let ticket = queue
        .enqueue(&WaiterClass::default(), 100_000, ledger.clone())
        .unwrap();
    assert_eq!(queue.depth(), 1);
    drop(ticket);
    assert_eq!((queue.depth(), queue.queued_tokens()), (0, 0));

    // Admitted by the dispatcher, but the caller left before taking it.
    let ticket = queue
        .enqueue(&WaiterClass::default(), 1_000, ledger.clone())
        .unwrap();
    let dispatcher = tokio::spawn(
        queue
            .clone()
            .dispatch(ledger.clone(), Arc::from("p"), || (LIMITS, 0)),
    );
    while queue.depth() > 0 {
        tokio::task::yield_now().await;
    }
    let held = ledger.snapshot("p", &LIMITS).await.unwrap();
    assert_eq!(
        held.in_flight_requests, 1,
        "the dispatcher handed it a reservation"
    );
    drop(ticket);
    let after = ledger.snapshot("p", &LIMITS).await.unwrap();
    assert_eq!((after.reserved_tokens, after.in_flight_requests), (0, 0));
    assert_eq!(after.tokens_available, 60_000, "released uncharged");
    queue.close();
    dispatcher.await.unwrap();
    assert_eq!(ledger.stats().unsettled_drops(), 0);
}

#[tokio::test(start_paused = true)]
async fn closing_answers_every_waiter_at_once() {
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(30), 100));
    let a = queue
        .enqueue(&WaiterClass::default(), 100_000, ledger.clone())
        .unwrap();
    let b = queue
        .enqueue(&WaiterClass::default(), 100_000, ledger.clone())
        .unwrap();
    let start = Instant::now();
    queue.close();
    assert_eq!(
        a.wait(start + Duration::from_secs(30)).await.unwrap_err(),
        WaitError::Shutdown
    );
    assert_eq!(
        b.wait(start + Duration::from_secs(30)).await.unwrap_err(),
        WaitError::Shutdown
    );
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(
        queue
            .enqueue(&WaiterClass::default(), 1, ledger.clone())
            .is_none(),
        "a closed queue takes no one"
    );
}

#[tokio::test]
async fn a_full_queue_takes_no_more() {
    let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Clock::tokio()));
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(1), 2));
    let _a = queue
        .enqueue(&WaiterClass::default(), 1, ledger.clone())
        .unwrap();
    let _b = queue
        .enqueue(&WaiterClass::default(), 1, ledger.clone())
        .unwrap();
    assert!(
        queue
            .enqueue(&WaiterClass::default(), 1, ledger.clone())
            .is_none()
    );
    drop(_a);
    assert!(
        queue.enqueue(&WaiterClass::default(), 1, ledger).is_some(),
        "room again once one leaves"
    );
}

#[tokio::test]
async fn returned_capacity_wakes_the_dispatcher_only_when_someone_waits() {
    use futures_util::FutureExt;
    let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Clock::tokio()));
    let queue = Arc::new(AdmissionQueue::new(Duration::from_secs(1), 2));
    // A wake with no dispatcher listening is kept as a permit: the next look returns at once.
    let woken = |queue: &AdmissionQueue| queue.wake.notified().now_or_never().is_some();

    queue.capacity_returned();
    assert!(!woken(&queue), "nobody waits: no look");

    let ticket = queue
        .enqueue(&WaiterClass::default(), 1, ledger.clone())
        .unwrap();
    assert!(woken(&queue), "an arrival wakes the dispatcher itself");
    queue.capacity_returned();
    assert!(woken(&queue), "someone waits: the dispatcher looks again");

    drop(ticket);
    assert!(woken(&queue), "a departure wakes it too");
    queue.capacity_returned();
    assert!(!woken(&queue), "the queue is empty again: no look");
}
