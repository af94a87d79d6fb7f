//! `tokengate top` in a pseudo-terminal: tmux runs it at 80x24 against a running proxy; the test
//! reads the screen until the pools (and their rates) show, then quits with `q`, and in a second
//! session with Ctrl-C, and checks that the command exited 0 and gave the terminal back (the
//! shell after it finds the tty out of raw mode, and the screen out of the alternate buffer).
//!
//! Without `tmux` on `PATH` the test records a visible skip, a failure under CI (`CI=true`), which
//! installs it.

use crate::common;

use std::{process::Command, time::Duration};

use crate::common::*;

/// A tmux server of this test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start() -> Option<Tmux> {
        if Command::new("tmux").arg("-V").output().is_err() {
            common::redis_server::skip::skip("tmux is not on PATH (apt-get install -y tmux)");
            return None;
        }
        Some(Tmux {
            socket: format!("tokengate-top-test-{}", std::process::id()),
        })
    }

    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux runs");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A detached 80x24 session running `command` in `sh`, kept on screen after it exits.
    fn session(&self, name: &str, command: &str) {
        self.run(&[
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "80",
            "-y",
            "24",
            "sh",
            "-c",
            command,
        ]);
        self.run(&["set-option", "-t", name, "remain-on-exit", "on"]);
    }

    /// The pane's screen, and its history (a dead pane's message scrolls the screen by a line).
    fn screen(&self, name: &str) -> String {
        self.run(&["capture-pane", "-p", "-S", "-100", "-t", name])
    }

    /// Polls the screen (bounded) until `done` holds.
    async fn wait_for(&self, name: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let screen = self.screen(name);
            if done(&screen) {
                return screen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what} did not show:\n{screen}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

fn pools() -> String {
    format!(
        "{}\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 100\n",
        sonnet_pool(200_000, 16)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_the_pools_and_quits_cleanly_on_q_and_ctrl_c() {
    let Some(tmux) = Tmux::start() else { return };
    let stack = Stack::start(
        "time_to_first_token_ms = 0\ntokens_per_second = 0\n",
        &pools(),
        "",
    )
    .await;
    let addr = stack.proxy.addr;
    for i in 0..5 {
        let r = raw_request(
            addr,
            "POST",
            &model_path(SONNET_US, "converse"),
            converse_body(&format!("[sim:output=20] {i}"), Some(100)),
            false,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let command = format!(
        "{} top --url http://{addr}; echo \"top exited $?\"; \
         echo \"tty: $(stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' ')\"",
        env!("CARGO_BIN_EXE_tokengate")
    );
    for (session, key) in [("q", "q"), ("ctrl-c", "C-c")] {
        tmux.session(session, &command);
        let screen = tmux
            .wait_for(session, "the pools with their rates", |s| {
                s.contains("sonnet4-us  ")
                    && s.contains("haiku")
                    && s.contains("0/16")
                    && !s.contains(" - ")
            })
            .await;
        for needle in [
            "tokengate top",
            "bucket fill",
            "adm/s",
            "sonnet4-us/default",
            "haiku/default",
            "ledger: memory",
        ] {
            assert!(
                screen.contains(needle),
                "{needle:?} not on screen:\n{screen}"
            );
        }
        assert!(screen.lines().all(|l| l.chars().count() <= 80));
        tmux.run(&["send-keys", "-t", session, key]);
        // The shell's last line, written in one piece after top has exited (tmux's own "Pane is
        // dead" notice is not waited for: under load it was seen to come late or not at all).
        let after = tmux
            .wait_for(session, "the exit", |s| {
                s.contains("top exited") && s.contains("tty: ")
            })
            .await;
        assert!(after.contains("top exited 0"), "{after}");
        // The terminal is back in cooked mode with echo, and out of the alternate screen.
        assert!(after.contains("tty: icanon echo"), "{after}");
        assert_eq!(
            tmux.run(&["display-message", "-p", "-t", session, "#{alternate_on}"])
                .trim(),
            "0"
        );
    }
    stack.assert_ledger_zero().await;
}
