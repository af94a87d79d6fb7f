//! The process's file descriptor limit (`RLIMIT_NOFILE`) against the connection cap.
//!
//! At start the soft limit is raised to the hard limit, as servers conventionally do (the soft
//! limit is often 1024, far below what the hard limit allows). The cap then applies only if the
//! descriptors can hold it: each connection with a call in flight may hold an upstream connection
//! too, and the process needs a few for itself (listeners, Redis, files), so the cap is at most
//! half of what is left after [`RESERVED`]. A configured cap above that is lowered, with a
//! warning, so that connections are shed before `accept` runs out of descriptors.

/// Descriptors kept for the process itself: listeners, the Redis ledger, logs, TLS files.
pub const RESERVED: u64 = 64;

/// Raises the soft limit to the hard one and returns the connection cap the limit allows for
/// `configured` (the same, or lowered with a warning).
pub fn connection_cap(configured: usize) -> usize {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_some() && limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit.current = limit.maximum,
            Err(e) => {
                tracing::warn!(error = %e, "could not raise the file descriptor limit to its hard limit")
            }
        }
    }
    let cap = cap_within(configured, limit.current);
    if cap < configured {
        tracing::warn!(
            max_connections = configured,
            nofile = limit.current,
            lowered_to = cap,
            "server.max_connections does not fit the file descriptor limit (RLIMIT_NOFILE); \
             raise the limit (ulimit -n) or lower max_connections"
        );
    }
    cap
}

/// The cap that `soft` descriptors allow for `configured` (`None`: no limit).
fn cap_within(configured: usize, soft: Option<u64>) -> usize {
    match soft {
        None => configured,
        Some(soft) => {
            let room = usize::try_from(soft.saturating_sub(RESERVED) / 2).unwrap_or(usize::MAX);
            configured.min(room.max(1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_room_for_upstream_connections_and_the_process() {
        assert_eq!(cap_within(1024, None), 1024);
        assert_eq!(cap_within(1024, Some(1_048_576)), 1024);
        assert_eq!(cap_within(1024, Some(1024)), (1024 - 64) / 2);
        assert_eq!(cap_within(1024, Some(10)), 1, "never zero");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let cap = connection_cap(1);
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(limit.current, limit.maximum);
        assert_eq!(cap, 1);
    }
}
