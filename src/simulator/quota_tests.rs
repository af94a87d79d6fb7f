use super::*;
use std::time::Duration;

fn bucket(tokens_per_minute: u64, tokens_per_day: Option<u64>, t0: Instant) -> Arc<Bucket> {
    Arc::new(Bucket::new(
        BucketInfo {
            tokens_per_minute,
            tokens_per_day,
            ..BucketInfo::default()
        },
        t0,
    ))
}

#[test]
fn reserve_settle_and_refill() {
    let t0 = Instant::now();
    let b = bucket(6000, None, t0); // refills 100 tokens/s
    let r = b
        .try_reserve(5000, t0, 0, None)
        .unwrap()
        .with_charge(100, 5);
    assert_eq!(b.stats(t0, 0).tokens_available, 1000);
    assert_eq!(
        b.try_reserve(1001, t0, 0, None).unwrap_err(),
        Shortfall::Minute
    );
    assert_eq!(b.stats(t0, 0).in_flight, 1);
    r.complete(0, 200, t0); // charge 100 + 200 x 5 = 1100
    let s = b.stats(t0, 0);
    assert_eq!(
        (s.tokens_available, s.tokens_charged, s.in_flight),
        (4900, 1100, 0)
    );
    assert_eq!(s.tokens_reserved_in_flight, 0);
    assert_eq!(
        b.stats(t0 + Duration::from_secs(1), 0).tokens_available,
        5000
    );
    assert_eq!(
        b.stats(t0 + Duration::from_secs(60), 0).tokens_available,
        6000,
        "capped"
    );
}

#[test]
fn burndown_can_overdraw_and_later_calls_wait_for_refill() {
    let t0 = Instant::now();
    let b = bucket(6000, None, t0);
    let r = b
        .try_reserve(1000, t0, 0, None)
        .unwrap()
        .with_charge(1000, 5);
    r.complete(0, 2000, t0); // 11000 charged against 6000
    assert_eq!(b.stats(t0, 0).tokens_available, -5000);
    assert!(b.try_reserve(1, t0, 0, None).is_err());
    assert!(
        b.try_reserve(1, t0 + Duration::from_secs(50), 0, None)
            .is_err()
    );
    assert!(
        b.try_reserve(100, t0 + Duration::from_secs(51), 0, None)
            .is_ok()
    );
}

#[test]
fn dropped_reservations_settle_at_what_was_generated() {
    let t0 = Instant::now();
    let b = bucket(60_000, None, t0);
    let mut r = b
        .try_reserve(10_000, t0, 0, None)
        .unwrap()
        .with_charge(100, 5);
    r.set_generated(10);
    drop(r);
    let s = b.stats(t0, 0);
    assert_eq!((s.tokens_charged, s.in_flight, s.completed), (150, 0, 0));
    let mut r = b
        .try_reserve(10_000, t0, 0, None)
        .unwrap()
        .with_charge(100, 1);
    r.set_generated(7);
    r.fail(t0);
    let s = b.stats(t0, 0);
    assert_eq!(
        (s.tokens_charged, s.errors, s.tokens_reserved_in_flight),
        (257, 1, 0)
    );
}

#[test]
fn the_day_is_reserved_and_settled_like_the_minute_and_never_refills() {
    let t0 = Instant::now();
    let b = bucket(60_000, Some(10_000), t0);
    let r = b
        .try_reserve(4_000, t0, 7, None)
        .unwrap()
        .with_charge(100, 5);
    assert_eq!(b.used_on(7), 4_000);
    r.complete(0, 300, t0); // 100 + 1500
    assert_eq!(b.used_on(7), 1_600);
    // An hour later the minute is full again; the day is not.
    let later = t0 + Duration::from_secs(3600);
    assert_eq!(
        b.try_reserve(8_401, later, 7, None).unwrap_err(),
        Shortfall::Day
    );
    let r = b.try_reserve(8_400, later, 7, None).unwrap();
    assert_eq!(b.used_on(7), 10_000);
    drop(r); // settles at 0: the day gives the reservation back
    assert_eq!(b.used_on(7), 1_600);
    // A new day starts from zero, and a call of the old day settled in it leaves it alone.
    let old = b
        .try_reserve(8_000, later, 7, None)
        .unwrap()
        .with_charge(9_000, 1);
    assert_eq!(b.used_on(8), 0);
    let r = b.try_reserve(10_000, later, 8, None).unwrap();
    old.complete(0, 0, later);
    assert_eq!(b.used_on(8), 10_000);
    drop(r);
    assert_eq!(b.used_on(8), 0);
}

#[test]
fn the_day_is_checked_before_the_minute() {
    let t0 = Instant::now();
    let b = bucket(100, Some(1_000), t0);
    b.set_used_on(1, 990);
    assert_eq!(
        b.try_reserve(200, t0, 1, None).unwrap_err(),
        Shortfall::Day,
        "fits neither: the day is what the caller must hear about"
    );
    assert_eq!(b.try_reserve(11, t0, 1, None).unwrap_err(), Shortfall::Day);
    assert!(b.try_reserve(10, t0, 1, None).is_ok());
}

#[test]
fn an_account_budget_spans_buckets_all_or_nothing() {
    let t0 = Instant::now();
    let account = Arc::new(DayBudget::new(1_000));
    let a = bucket(60_000, Some(100_000), t0);
    let b = bucket(60_000, Some(100_000), t0);
    let ra = a
        .try_reserve(600, t0, 3, Some(&account))
        .unwrap()
        .with_charge(600, 1);
    assert_eq!(
        b.try_reserve(401, t0, 3, Some(&account)).unwrap_err(),
        Shortfall::Day
    );
    // The refused call took nothing anywhere.
    assert_eq!((b.used_on(3), b.stats(t0, 3).tokens_available), (0, 60_000));
    let rb = b.try_reserve(400, t0, 3, Some(&account)).unwrap();
    assert_eq!(account.used(3), 1_000);
    ra.complete(0, 0, t0);
    drop(rb);
    assert_eq!(account.used(3), 600);
    assert_eq!(account.used(4), 0, "a new day");
}

#[test]
fn tallies_count_charges_and_outcomes() {
    let t0 = Instant::now();
    let b = bucket(60_000, None, t0);
    let api = Arc::new(Tally::default());
    let tier = Arc::new(Tally::default());
    let r = b
        .try_reserve(1_000, t0, 0, None)
        .unwrap()
        .with_charge(10, 5)
        .with_tallies(vec![Arc::clone(&api), Arc::clone(&tier)]);
    r.complete(2, 20, t0);
    let mut r = b
        .try_reserve(1_000, t0, 0, None)
        .unwrap()
        .with_charge(10, 5)
        .with_tallies(vec![Arc::clone(&api)]);
    r.set_generated(4);
    r.fail(t0);
    let (a, t) = (api.snapshot(), tier.snapshot());
    assert_eq!((a.tokens_charged, a.completed, a.errors), (112 + 30, 1, 1));
    assert_eq!((t.tokens_charged, t.completed, t.errors), (112, 1, 0));
}
