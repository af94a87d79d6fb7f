//! Skips that show. A test that cannot run here (a tool it needs is not installed) calls
//! [`skip`]: under CI (`CI=true`, which `.ci/run` sets) that is a failure, since CI must run
//! every test; elsewhere the test returns early, and the skip is named on stderr and appended to
//! `skipped-tests.txt` in the target's temporary directory, which `scripts/test.sh` empties
//! before a run and prints, with a count, after it.

use std::io::Write;

/// The file every test binary appends its skips to.
pub fn skip_file() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt")
}

/// Records that the running test is skipped for `reason`, or fails it under CI.
pub fn skip(reason: &str) {
    let test = format!(
        "{}::{}",
        env!("CARGO_CRATE_NAME"),
        std::thread::current().name().unwrap_or("?")
    );
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {reason}; CI runs every test, so here this is a failure"
    );
    eprintln!("SKIPPED {test}: {reason}");
    let line = format!("{test}: {reason}\n");
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(skip_file())
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = appended {
        eprintln!(
            "could not record the skip in {}: {e}",
            skip_file().display()
        );
    }
}
