//! The process's log output: stderr, written in batches by a thread of its own, so that no
//! request waits on a `write` to stderr (one per access-log line, on the request's path, before
//! its answer's last bytes went out).
//!
//! A line is appended to a shared buffer under a mutex (formatting stays on the caller's thread);
//! the writer thread takes the buffer and writes it whole every [`FLUSH_EVERY`], or at once when
//! it holds [`FLUSH_AT`] bytes (it is woken then). So a line reaches stderr within
//! [`FLUSH_EVERY`], lines keep their order, and a line is never split or dropped. Warnings and
//! errors, rare and wanted at once, are written by the caller straight away, after what is
//! buffered before them: when `tracing::error!` returns, its line is on stderr.
//!
//! Bounds and failure semantics:
//! - **Memory**: a caller that finds [`MAX_BUFFERED`] bytes waiting (stderr slower than the
//!   proxy logs: a blocked pipe) writes the buffer itself, holding the lock: logging then slows
//!   the requests down as unbuffered logging would, rather than growing without bound.
//! - **Exit**: [`LogWriter::flush_stderr`] writes what is buffered; `main` calls it after the runtime
//!   stops and from its panic hook. A process killed outright (`SIGKILL`) loses at most the
//!   last [`FLUSH_EVERY`] of lines.
//! - **Write errors** (stderr closed) are ignored, as `eprintln!`'s would panic and
//!   `tracing_subscriber`'s own stderr writer ignores them.

use std::{
    io::{self, Write},
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock},
    time::Duration,
};

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in the buffer.
pub const FLUSH_EVERY: Duration = Duration::from_millis(50);
/// The writer thread is woken to write at once when this much is buffered.
pub const FLUSH_AT: usize = 64 * 1024;
/// A caller that finds this much buffered writes it itself (see the module doc).
pub const MAX_BUFFERED: usize = 1024 * 1024;

/// The buffered stderr writer; see the module doc. Cloning shares the buffer.
#[derive(Clone, Debug)]
pub struct LogWriter {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    buffer: Mutex<Vec<u8>>,
    /// Wakes the writer thread early ([`FLUSH_AT`]).
    full: Condvar,
}

/// The process's writer, once logging has started.
static WRITER: OnceLock<LogWriter> = OnceLock::new();

impl LogWriter {
    /// The process's writer, its thread started on first use.
    pub fn stderr() -> LogWriter {
        WRITER
            .get_or_init(|| {
                let writer = LogWriter {
                    shared: Arc::default(),
                };
                let shared = writer.shared.clone();
                // Without its thread the writer still works: callers write at FLUSH_AT.
                let _ = std::thread::Builder::new()
                    .name("tokengate-log".into())
                    .spawn(move || shared.run(&mut io::stderr()));
                writer
            })
            .clone()
    }

    /// Writes what the process's writer has buffered to stderr now (nothing if logging never
    /// started).
    pub fn flush_stderr() {
        if let Some(writer) = WRITER.get() {
            writer.shared.write_out(&mut io::stderr());
        }
    }

    /// Appends one formatted log line (or any bytes) to the buffer; `out` is where a buffer at
    /// its bound is written first, and where an `urgent` line is written at once with the
    /// buffer before it.
    fn append(&self, bytes: &[u8], urgent: bool, out: &mut impl Write) {
        let mut buffer = self.shared.lock();
        if buffer.len() >= MAX_BUFFERED {
            write_all(out, &mut buffer);
        }
        buffer.extend_from_slice(bytes);
        if urgent {
            write_all(out, &mut buffer);
        } else if buffer.len() >= FLUSH_AT {
            self.shared.full.notify_one();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        // A panic while holding the lock leaves a buffer of whole lines: keep using it.
        self.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The writer thread: writes the buffer out every [`FLUSH_EVERY`], or when woken.
    fn run(&self, out: &mut impl Write) {
        loop {
            let taken = {
                let buffer = self.lock();
                let (mut buffer, _) = self
                    .full
                    .wait_timeout_while(buffer, FLUSH_EVERY, |b| b.len() < FLUSH_AT)
                    .unwrap_or_else(|e| e.into_inner());
                std::mem::take(&mut *buffer)
            };
            let mut taken = taken;
            write_all(out, &mut taken);
            // Give the allocation back when the buffer is empty, so it is reused.
            let mut buffer = self.lock();
            if buffer.is_empty() && buffer.capacity() < taken.capacity() {
                *buffer = taken;
            }
        }
    }

    fn write_out(&self, out: &mut impl Write) {
        let mut buffer = self.lock();
        write_all(out, &mut buffer);
    }
}

/// Writes `bytes` out and empties it, keeping its allocation.
fn write_all(out: &mut impl Write, bytes: &mut Vec<u8>) {
    if !bytes.is_empty() {
        let _ = out.write_all(bytes);
        let _ = out.flush();
        bytes.clear();
    }
}

/// Whether a line of `level` is written at once: warnings and errors.
fn urgent(level: Level) -> bool {
    level <= Level::WARN
}

/// One event's writer: `tracing_subscriber` formats a line, then writes it with one call.
/// `urgent` for warnings and errors.
#[derive(Debug)]
pub struct LineWriter<'a> {
    log: &'a LogWriter,
    urgent: bool,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.log.append(bytes, self.urgent, &mut io::stderr());
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            log: self,
            urgent: false,
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        LineWriter {
            log: self,
            urgent: urgent(*meta.level()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer() -> LogWriter {
        LogWriter {
            shared: Arc::default(),
        }
    }

    #[test]
    fn lines_from_many_threads_come_out_whole_and_in_each_threads_order() {
        let log = writer();
        std::thread::scope(|s| {
            for t in 0..4 {
                let log = log.clone();
                s.spawn(move || {
                    for i in 0..1000 {
                        let line = format!("thread {t} line {i:04} {}\n", "x".repeat(i % 97));
                        log.make_writer().write_all(line.as_bytes()).unwrap();
                    }
                });
            }
        });
        let mut out = Vec::new();
        log.shared.write_out(&mut out);
        let text = String::from_utf8(out).unwrap();
        let mut next = [0usize; 4];
        for line in text.lines() {
            let words: Vec<&str> = line.split(' ').collect();
            let (t, i): (usize, usize) = (words[1].parse().unwrap(), words[3].parse().unwrap());
            assert_eq!(
                i, next[t],
                "thread {t}'s lines out of order or split: {line:?}"
            );
            assert_eq!(words.get(4).map_or(0, |x| x.len()), i % 97);
            next[t] += 1;
        }
        assert_eq!(next, [1000; 4]);
        assert!(log.shared.lock().is_empty());
    }

    #[test]
    fn the_writer_thread_writes_within_its_interval_and_a_full_buffer_at_once() {
        let log = writer();
        let sink = Arc::new(Mutex::new(Vec::new()));
        let (shared, out) = (log.shared.clone(), sink.clone());
        std::thread::spawn(move || shared.run(&mut SharedSink(out)));
        log.make_writer().write_all(b"one line\n").unwrap();
        // Polls for the line: it must arrive (within FLUSH_EVERY on a quiet machine).
        while sink.lock().unwrap().is_empty() {
            std::thread::yield_now();
        }
        assert_eq!(&*sink.lock().unwrap(), b"one line\n");
        let big = vec![b'y'; FLUSH_AT];
        log.make_writer().write_all(&big).unwrap();
        while sink.lock().unwrap().len() < FLUSH_AT + 9 {
            std::thread::yield_now();
        }
        assert!(log.shared.lock().is_empty());
    }

    #[test]
    fn a_caller_that_finds_the_buffer_at_its_bound_writes_it_itself() {
        let log = writer();
        // No writer thread: the bound alone keeps the buffer from growing.
        let chunk = vec![b'z'; 4096];
        let mut written = Vec::new();
        let rounds = 3 * MAX_BUFFERED / chunk.len();
        for _ in 0..rounds {
            log.append(&chunk, false, &mut written);
            assert!(log.shared.lock().len() <= MAX_BUFFERED + chunk.len());
        }
        log.shared.write_out(&mut written);
        assert_eq!(written.len(), rounds * chunk.len(), "nothing dropped");
    }

    #[test]
    fn a_warning_goes_out_at_once_after_the_lines_before_it() {
        let log = writer();
        let mut out = Vec::new();
        log.append(b"info 1\n", false, &mut out);
        log.append(b"info 2\n", false, &mut out);
        assert!(out.is_empty(), "info lines wait for the writer thread");
        log.append(b"warn 3\n", true, &mut out);
        assert_eq!(out, b"info 1\ninfo 2\nwarn 3\n");
        assert!(log.shared.lock().is_empty());
        assert!(urgent(Level::ERROR) && urgent(Level::WARN));
        assert!(!urgent(Level::INFO) && !urgent(Level::DEBUG));
    }

    struct SharedSink(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedSink {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}
