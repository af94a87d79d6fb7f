//! Log output captured in memory as JSON lines, to read the access log back in a test.
//!
//! Install it with `tracing::subscriber::set_default` on a current-thread runtime, so that the
//! proxy's tasks run on the thread that holds the subscriber.

use std::{
    io::Write,
    sync::{Arc, Mutex},
};

use serde_json::Value;

#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

impl Capture {
    /// A JSON subscriber writing into this capture, at INFO.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        tracing_subscriber::fmt()
            .json()
            .with_writer(self.clone())
            .with_max_level(tracing::Level::INFO)
            .finish()
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().expect("lock").clone()).expect("utf8")
    }

    /// The access-log lines' fields.
    pub fn access_lines(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
            .filter(|v| v["target"] == "tokengate::access")
            .map(|v| v["fields"].clone())
            .collect()
    }
}
