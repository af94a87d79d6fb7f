//! A steady trickle of Converse calls, one after another, counted by answer: to keep a proxy
//! busy while a test breaks its ledger.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use super::converse;

/// Sends Converse calls to `model` one after another until stopped; counts answers by status.
pub struct Load {
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

/// Answers so far: 200, 503, anything else.
#[derive(Debug, Default)]
pub struct Counts {
    pub ok: AtomicU64,
    pub unavailable: AtomicU64,
    pub other: AtomicU64,
}

impl Load {
    /// Starts the calls: `[sim:output=20] hello` with maxTokens 100.
    pub fn start(addr: SocketAddr, model: &'static str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Counts::default());
        let task = tokio::spawn({
            let (stop, counts) = (stop.clone(), counts.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    let r = converse(addr, model, "[sim:output=20] hello", Some(100)).await;
                    let counter = match r.status {
                        200 => &counts.ok,
                        503 => &counts.unavailable,
                        _ => &counts.other,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Load { stop, counts, task }
    }

    /// The answers so far, as they come.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Stops after the call in progress; (200s, 503s, others).
    pub async fn stop(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("load task");
        let c = &self.counts;
        (
            c.ok.load(Ordering::Relaxed),
            c.unavailable.load(Ordering::Relaxed),
            c.other.load(Ordering::Relaxed),
        )
    }
}
