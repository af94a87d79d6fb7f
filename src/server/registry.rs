//! The open connections of one listener, and the cap on them (`server.max_connections`).
//!
//! # At the cap
//! A newly accepted connection that would take the count past the cap makes room by closing the
//! oldest idle connection (no request in flight: nothing is cut short, and a client's pool opens
//! another when it needs one). Only when every connection has a request in flight is the newcomer
//! refused: its socket is closed at once, before a byte is read. Both count in
//! `tokengate_connections_shed_total{action}`. A connection being closed to make room no longer
//! counts against the cap, so file descriptors stay within the cap plus the few closing.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::connection::Activity;
use crate::metrics::ListenerMetrics;

/// The connections of one listener.
#[derive(Debug)]
pub struct Connections {
    cap: usize,
    table: Mutex<Table>,
    next_id: AtomicU64,
    emptied: Notify,
    metrics: Option<ListenerMetrics>,
}

#[derive(Debug, Default)]
struct Table {
    /// By id, which grows with each accept: the first is the oldest.
    open: BTreeMap<u64, Entry>,
    /// Entries closed to make room that have not finished closing.
    shedding: usize,
}

#[derive(Debug)]
struct Entry {
    activity: Arc<Activity>,
    close: CancellationToken,
    shed: bool,
}

/// A connection's place in the table; leaving it (drop) frees the place.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    pub activity: Arc<Activity>,
    /// Cancelled when the connection must close at once (shed, or shutdown's last step).
    pub close: CancellationToken,
    connections: Arc<Connections>,
}

impl Slot {
    pub fn metrics(&self) -> Option<&ListenerMetrics> {
        self.connections.metrics.as_ref()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.connections.remove(self.id);
    }
}

impl Connections {
    pub fn new(cap: usize, metrics: Option<ListenerMetrics>) -> Arc<Connections> {
        Arc::new(Connections {
            cap,
            table: Mutex::new(Table::default()),
            next_id: AtomicU64::new(0),
            emptied: Notify::new(),
            metrics,
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connections open now (those closing included).
    pub fn len(&self) -> usize {
        self.table().open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place for a newly accepted connection, making room at the cap (see the module doc);
    /// `None` if every connection has a request in flight.
    pub fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut table = self.table();
        if table.open.len() - table.shedding >= self.cap {
            let oldest_idle = table
                .open
                .values_mut()
                .find(|e| !e.shed && !e.close.is_cancelled() && e.activity.is_idle());
            match oldest_idle {
                Some(entry) => {
                    entry.shed = true;
                    entry.close.cancel();
                    table.shedding += 1;
                    if let Some(m) = &self.metrics {
                        m.closed_idle.inc();
                    }
                }
                None => {
                    if let Some(m) = &self.metrics {
                        m.refused.inc();
                    }
                    return None;
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(Activity::new());
        let close = CancellationToken::new();
        table.open.insert(
            id,
            Entry {
                activity: activity.clone(),
                close: close.clone(),
                shed: false,
            },
        );
        self.set_gauge(&table);
        Some(Slot {
            id,
            activity,
            close,
            connections: self.clone(),
        })
    }

    fn remove(&self, id: u64) {
        let mut table = self.table();
        if table.open.remove(&id).is_some_and(|entry| entry.shed) {
            table.shedding -= 1;
        }
        self.set_gauge(&table);
        if table.open.is_empty() {
            self.emptied.notify_waiters();
        }
    }

    fn set_gauge(&self, table: &Table) {
        if let Some(m) = &self.metrics {
            m.open.set(table.open.len() as i64);
        }
    }

    /// Closes every connection at once (the last step of shutdown).
    pub fn close_all(&self) {
        for entry in self.table().open.values() {
            entry.close.cancel();
        }
    }

    /// Resolves once no connection is open.
    pub async fn emptied(&self) {
        loop {
            let notified = self.emptied.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Version;

    fn metrics() -> ListenerMetrics {
        let (_, metrics) = crate::metrics::Metrics::standalone();
        metrics.listener("proxy")
    }

    #[test]
    fn at_the_cap_the_oldest_idle_connection_makes_room() {
        let m = metrics();
        let connections = Connections::new(3, Some(m.clone()));
        let slots: Vec<Slot> = (0..3).map(|_| connections.admit().expect("room")).collect();
        slots[0].activity.request_started(Version::HTTP_11);
        let fourth = connections.admit().expect("an idle one makes room");
        assert!(!slots[0].close.is_cancelled(), "busy: kept");
        assert!(
            slots[1].close.is_cancelled(),
            "the oldest idle one is closed"
        );
        assert!(!slots[2].close.is_cancelled());
        assert_eq!((m.closed_idle.get(), m.open.get()), (1, 4));

        // The one closing no longer counts: the next newcomer sheds the next oldest idle one.
        let fifth = connections.admit().expect("room");
        assert!(slots[2].close.is_cancelled());
        assert!(!fourth.close.is_cancelled(), "newer than the ones shed");
        assert_eq!((m.closed_idle.get(), m.open.get()), (2, 5));
        drop(fifth);
        drop(slots);
        drop(fourth);
        assert!(connections.is_empty());
        assert_eq!(m.open.get(), 0);
    }

    #[test]
    fn with_every_connection_busy_the_newcomer_is_refused() {
        let m = metrics();
        let connections = Connections::new(2, Some(m.clone()));
        let slots: Vec<Slot> = (0..2).map(|_| connections.admit().expect("room")).collect();
        for slot in &slots {
            slot.activity.request_started(Version::HTTP_2);
        }
        assert!(connections.admit().is_none());
        assert_eq!((m.refused.get(), m.closed_idle.get()), (1, 0));
        slots[1].activity.request_ended();
        assert!(connections.admit().is_some(), "idle again: it makes room");
        assert!(slots[1].close.is_cancelled());
    }

    #[tokio::test]
    async fn emptied_resolves_when_the_last_connection_leaves() {
        let connections = Connections::new(8, None);
        let slot = connections.admit().expect("room");
        let waiter = tokio::spawn({
            let connections = connections.clone();
            async move { connections.emptied().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(slot);
        waiter.await.expect("emptied");
    }
}
