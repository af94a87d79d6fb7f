//! A task's waker that answers a wake-up made during the task's own poll with another poll,
//! instead of a trip through the scheduler.
//!
//! tokio puts a task woken during its own poll at the back of the run queue and wakes another
//! worker thread to steal it: a futex call and a context switch when the other worker is idle
//! (every call at a moderate rate; loadtest/RESULTS.md, issue #19, session 8). Two tasks wake
//! themselves on every call:
//! - **a listener's connection** ([`crate::server`]): hyper runs an HTTP/1.1 request's handler
//!   inside the connection's future, and hands it the request body through a channel whose
//!   receiver wakes the sender (the connection's dispatcher, the same task) on every chunk taken;
//! - **an upstream HTTP/2 connection** ([`crate::upstream`]), whose I/O, dispatch and per-request
//!   response waits run in one task and wake one another.
//!
//! [`OwnWake::poll`] polls the inner future with a waker of its own. A wake-up while that poll runs
//! (from this task or any other) is recorded, and answered by polling again at once; a wake-up at
//! any other time wakes the task. Polling again is bounded ([`MAX_POLLS`]): a future that wakes
//! itself on purpose (hyper's fairness yield, tokio's cooperative budget running out) then gets
//! the scheduler's turn it asked for.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use futures_util::task::AtomicWaker;

/// Not inside [`OwnWake::poll`]: a wake-up wakes the task.
const IDLE: u8 = 0;
/// Inside a poll, not woken yet.
const POLLING: u8 = 1;
/// Woken during the poll: poll again.
const WOKEN: u8 = 2;

/// Polls of the inner future per poll of the task, at most.
pub(crate) const MAX_POLLS: usize = 4;

/// One task's: the state its inner future's wake-ups are recorded in, and the waker that records
/// them (made once per task).
#[derive(Debug)]
pub(crate) struct OwnWake {
    shared: Arc<Shared>,
    waker: Waker,
}

#[derive(Debug)]
struct Shared {
    state: AtomicU8,
    task: AtomicWaker,
}

impl OwnWake {
    pub(crate) fn new() -> OwnWake {
        let shared = Arc::new(Shared {
            state: AtomicU8::new(IDLE),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(shared.clone());
        OwnWake { shared, waker }
    }

    /// The waker the inner future is polled with, for whatever else should wake it the same way.
    pub(crate) fn waker(&self) -> &Waker {
        &self.waker
    }

    /// Polls `inner` with [`OwnWake::waker`] until it is ready or was not woken during its poll,
    /// at most [`MAX_POLLS`] times; past that, wakes the task.
    pub(crate) fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut inner: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        let shared = &self.shared;
        shared.task.register(cx.waker());
        let mut own = Context::from_waker(&self.waker);
        for _ in 0..MAX_POLLS {
            shared.state.store(POLLING, Ordering::SeqCst);
            let polled = inner(&mut own);
            let woken = shared.state.swap(IDLE, Ordering::SeqCst) == WOKEN;
            if polled.is_ready() || !woken {
                return polled;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::SeqCst, Ordering::SeqCst)
        {
            // Recorded: the poll running now polls again.
            Ok(_) | Err(WOKEN) => {}
            // Nobody is polling: wake the task.
            Err(_) => self.task.wake(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts the task's wake-ups.
    #[derive(Default)]
    struct Task(AtomicUsize);

    impl Task {
        fn wakes(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One poll of a task whose connection is `inner`, through a fresh [`OwnWake`]; what it gave,
    /// the `OwnWake` for further polls, and the task.
    fn poll_task<T>(
        inner: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> (Poll<T>, OwnWake, Arc<Task>) {
        let own = OwnWake::new();
        let task = Arc::new(Task::default());
        let task_waker = Waker::from(task.clone());
        let polled = own.poll(&mut Context::from_waker(&task_waker), inner);
        (polled, own, task)
    }

    #[test]
    fn a_wake_up_during_the_poll_is_answered_by_polling_again_not_by_the_task() {
        let mut polls = 0;
        let (polled, _, task) = poll_task(|cx| {
            polls += 1;
            if polls == 1 {
                // Like the handler taking a body chunk from the dispatcher in the same task.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(polls)
        });
        assert_eq!(polled, Poll::Ready(2));
        assert_eq!(task.wakes(), 0, "the task was not woken");
    }

    #[test]
    fn a_wake_up_after_the_poll_wakes_the_task() {
        let mut stored = None;
        let (polled, _, task) = poll_task(|cx| {
            stored = Some(cx.waker().clone());
            Poll::<()>::Pending
        });
        assert!(polled.is_pending());
        assert_eq!(task.wakes(), 0);
        // Another task (upstream's answer, a timer) wakes it later.
        stored.expect("registered").wake();
        assert_eq!(task.wakes(), 1);
    }

    #[test]
    fn a_future_that_keeps_waking_itself_gets_the_schedulers_turn() {
        let mut polls = 0;
        let (polled, own, task) = poll_task(|cx| {
            polls += 1;
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        });
        assert!(polled.is_pending());
        assert_eq!(polls, MAX_POLLS);
        assert_eq!(task.wakes(), 1, "yielded to the scheduler once");
        // The next poll of the task starts afresh.
        let task_waker = Waker::from(task.clone());
        let polled = own.poll(&mut Context::from_waker(&task_waker), |_| Poll::Ready(()));
        assert!(polled.is_ready());
    }

    #[test]
    fn a_wake_up_from_another_thread_during_the_poll_is_not_lost() {
        let mut polls = 0;
        let (polled, _, task) = poll_task(|cx| {
            polls += 1;
            if polls == 1 {
                let remote = cx.waker().clone();
                std::thread::spawn(move || remote.wake())
                    .join()
                    .expect("waker thread");
                return Poll::Pending;
            }
            Poll::Ready(())
        });
        assert!(polled.is_ready(), "polled again for the remote wake-up");
        assert_eq!(polls, 2);
        assert_eq!(task.wakes(), 0);
    }
}
