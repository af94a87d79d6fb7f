//! One pool's recent history: a [`Tally`] per minute with traffic, and per hour the
//! distributions of input and output tokens per call and of queue waits. Bounded: minutes older
//! than the window are dropped as new ones arrive (at most `window` minute slots and
//! `window / 60 + 1` hour slots), so a pool holds at most about 150 KiB for a day.

use std::{
    collections::VecDeque,
    sync::{Mutex, MutexGuard},
};

use super::super::tally::{Event, Tally, millis};
use crate::admission::advice::Lengths;

/// Distributions of one hour.
#[derive(Debug, Default)]
pub struct HourSlot {
    pub hour: u64,
    /// Input tokens charged per call with usage (`inputTokens + cacheWriteInputTokens`).
    pub input: Lengths,
    pub output: Lengths,
    /// Milliseconds queued requests waited.
    pub queue_wait: Lengths,
}

#[derive(Debug, Default)]
struct Slots {
    /// (minute, its tally), oldest first; only minutes with something in them.
    minutes: VecDeque<(u64, Tally)>,
    hours: VecDeque<HourSlot>,
}

/// One pool's window.
#[derive(Debug)]
pub struct PoolWindow {
    /// The window's length in minutes.
    minutes: u64,
    slots: Mutex<Slots>,
}

impl PoolWindow {
    pub fn new(minutes: u64) -> PoolWindow {
        PoolWindow {
            minutes: minutes.max(1),
            slots: Mutex::new(Slots::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `event` in minute `minute` (minutes since the recorder's clock started).
    pub fn record(&self, minute: u64, event: &Event) {
        let mut slots = self.lock();
        slots.prune(minute, self.minutes);
        match slots.minutes.back_mut() {
            Some((m, tally)) if *m == minute => tally.record(event),
            // A late event of an earlier minute (a settlement racing the minute's turn) counts
            // in the newest one: minutes only ever grow at the back.
            Some((m, tally)) if *m > minute => tally.record(event),
            _ => {
                let mut tally = Tally::default();
                tally.record(event);
                slots.minutes.push_back((minute, tally));
            }
        }
        let hour = minute / 60;
        if slots.hours.back().is_none_or(|h| h.hour < hour) {
            slots.hours.push_back(HourSlot {
                hour,
                ..HourSlot::default()
            });
        }
        let Some(h) = slots.hours.back() else { return };
        match *event {
            Event::Settled {
                usage: Some(usage), ..
            } => {
                h.input.record(
                    usage
                        .input_tokens
                        .saturating_add(usage.cache_write_input_tokens),
                );
                h.output.record(usage.output_tokens);
            }
            Event::Admitted {
                queued_for: Some(w),
                ..
            }
            | Event::Throttled {
                queued_for: Some(w),
                ..
            } => h.queue_wait.record(millis(w)),
            _ => {}
        }
    }

    /// The minutes within the window ending at `now` (oldest first), and the window's
    /// distributions merged (hours that overlap the window, so up to 59 minutes more).
    pub fn read(&self, now: u64) -> (Vec<(u64, Tally)>, HourSlot) {
        let mut slots = self.lock();
        slots.prune(now, self.minutes);
        let merged = HourSlot::default();
        for h in &slots.hours {
            merged.input.absorb(&h.input);
            merged.output.absorb(&h.output);
            merged.queue_wait.absorb(&h.queue_wait);
        }
        (slots.minutes.iter().copied().collect(), merged)
    }
}

impl Slots {
    /// Drops the minutes (and hours) that left the window ending at minute `now`.
    fn prune(&mut self, now: u64, window: u64) {
        let oldest = (now + 1).saturating_sub(window);
        while self.minutes.front().is_some_and(|(m, _)| *m < oldest) {
            self.minutes.pop_front();
        }
        while self.hours.front().is_some_and(|h| h.hour < oldest / 60) {
            self.hours.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bedrock::Usage;

    fn admitted(reserved: u64) -> Event {
        Event::Admitted {
            reserved,
            in_flight: 1,
            queued_for: None,
            spilled: false,
        }
    }

    #[test]
    fn minutes_leave_the_window_and_memory_stays_bounded() {
        let w = PoolWindow::new(60);
        for minute in 0..500 {
            w.record(minute, &admitted(minute));
        }
        let (minutes, _) = w.read(499);
        assert_eq!(minutes.len(), 60);
        assert_eq!(minutes[0].0, 440);
        assert_eq!(minutes[59].1.reserved_tokens, 499);
        assert!(w.lock().hours.len() <= 2, "{}", w.lock().hours.len());
        // Nothing for an hour: the window is empty.
        let (minutes, merged) = w.read(600);
        assert!(minutes.is_empty());
        assert_eq!(merged.output.quantile(0.5), None);
    }

    #[test]
    fn distributions_merge_the_hours_in_the_window() {
        let w = PoolWindow::new(120);
        let settled = |input, output| Event::Settled {
            charge: 0,
            usage: Some(Usage {
                input_tokens: input,
                output_tokens: output,
                cache_read_input_tokens: 1000,
                cache_write_input_tokens: 2,
            }),
        };
        w.record(10, &settled(5, 7));
        w.record(70, &settled(1, 3));
        let (minutes, merged) = w.read(70);
        assert_eq!(minutes.len(), 2);
        assert_eq!(merged.input.quantile(1.0), Some(7), "cache reads are free");
        assert_eq!(merged.output.quantile(0.5), Some(3));
        assert_eq!(merged.output.quantile(1.0), Some(7));
    }
}
