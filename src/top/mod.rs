//! `tokengate top --url URL`: the pools of a running proxy at a glance, in a terminal, refreshed
//! every second from its `GET /v1/pools` (plain HTTP: the proxy's listener, or its
//! `server.admin_listen`).
//!
//! Per pool: the bucket's fill (tokens available of the effective limit), tokens reserved by
//! requests in flight and charged per minute, requests in flight against the limit, the queue's
//! depth and oldest wait, and admissions, rejections and upstream throttles per second; per
//! route the same in short. Rates are over the last five readings (about five seconds).
//!
//! A thread reads the endpoint; the terminal thread draws and reads keys, so `q`, `Esc` and
//! Ctrl-C quit at once even while the proxy is slow to answer. The terminal is restored on every
//! way out (quit, error, panic). A proxy that cannot be read is said so on the status line, with
//! the last reading kept on screen.

mod sample;
pub mod view;

use std::{
    sync::mpsc,
    time::{Duration, Instant},
};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};

pub use sample::{Reading, Sample};

/// Why `top` stopped.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error("{0:?} is not a plain-HTTP URL like http://127.0.0.1:8080")]
    BadUrl(String),
    #[error("the terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

/// What the screen shows: the last two readings, and what went wrong since, if anything.
#[derive(Debug, Default)]
pub struct Screen {
    pub url: String,
    pub reading: Option<Reading>,
    pub error: Option<String>,
}

impl Screen {
    fn update(&mut self, fetched: Result<Sample, String>) {
        match fetched {
            Ok(sample) => {
                self.reading = Some(match self.reading.take() {
                    Some(last) => last.next(sample),
                    None => Reading::first(sample),
                });
                self.error = None;
            }
            Err(e) => self.error = Some(e),
        }
    }
}

/// Runs until the user quits.
pub fn run(url: &str, interval: Duration) -> Result<(), TopError> {
    let base = url.trim_end_matches('/').to_string();
    if !base.starts_with("http://") {
        return Err(TopError::BadUrl(url.to_string()));
    }
    let (tx, samples) = mpsc::channel();
    let endpoint = format!("{base}/v1/pools");
    std::thread::spawn(move || {
        loop {
            let started = Instant::now();
            let fetched = sample::fetch(&endpoint, interval.max(Duration::from_millis(500)));
            if tx.send(fetched).is_err() {
                return;
            }
            std::thread::sleep(interval.saturating_sub(started.elapsed()));
        }
    });
    let mut terminal = ratatui::try_init()?;
    let mut screen = Screen {
        url: base,
        ..Screen::default()
    };
    let result = draw_until_quit(&mut terminal, &mut screen, &samples);
    ratatui::try_restore()?;
    result
}

fn draw_until_quit(
    terminal: &mut ratatui::DefaultTerminal,
    screen: &mut Screen,
    samples: &mpsc::Receiver<Result<Sample, String>>,
) -> Result<(), TopError> {
    loop {
        while let Ok(fetched) = samples.try_recv() {
            screen.update(fetched);
        }
        terminal.draw(|frame| view::render(frame, screen))?;
        if !event::poll(Duration::from_millis(100))? {
            continue;
        }
        if let Event::Key(key) = event::read()? {
            let ctrl_c = key.modifiers.contains(KeyModifiers::CONTROL)
                && matches!(key.code, KeyCode::Char('c' | 'C'));
            let quit = matches!(key.code, KeyCode::Char('q' | 'Q') | KeyCode::Esc);
            if key.kind == KeyEventKind::Press && (quit || ctrl_c) {
                return Ok(());
            }
        }
    }
}
