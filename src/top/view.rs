//! Drawing one frame of `tokengate top`: a title line, the pools, the routes, a status line.
//! Everything fits in 80 columns (pool names beyond 12 characters are cut).

use ratatui::{
    Frame,
    layout::{Constraint, Layout},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Block, Cell, Row, Table},
};

use super::{
    Screen,
    sample::{PoolSample, RATE_WINDOW, Rates},
};

const POOL_COLUMNS: [Constraint; 9] = [
    Constraint::Length(12),
    Constraint::Length(14),
    Constraint::Length(8),
    Constraint::Length(7),
    Constraint::Length(6),
    Constraint::Length(7),
    Constraint::Length(5),
    Constraint::Length(5),
    Constraint::Length(5),
];
const ROUTE_COLUMNS: [Constraint; 5] = [
    Constraint::Length(26),
    Constraint::Length(8),
    Constraint::Length(7),
    Constraint::Length(5),
    Constraint::Length(5),
];
const BAR: usize = 9;

pub fn render(frame: &mut Frame, screen: &Screen) {
    let pools = screen.reading.as_ref().map_or(0, |r| r.sample.pools.len());
    let [title, pool_area, route_area, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(pools as u16 + 3),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let ledger = screen
        .reading
        .as_ref()
        .map_or("?", |r| r.sample.ledger.as_str());
    frame.render_widget(
        Line::from(vec![
            Span::styled(
                " tokengate top ",
                Style::new().add_modifier(Modifier::REVERSED),
            ),
            Span::raw(format!(" {}  ledger: {ledger}", screen.url)),
        ]),
        title,
    );
    frame.render_widget(pool_table(screen), pool_area);
    frame.render_widget(route_table(screen), route_area);
    let line = match &screen.error {
        Some(e) => Line::styled(format!(" {e}"), Style::new().fg(Color::Red)),
        None if screen.reading.is_none() => Line::raw(" reading /v1/pools ..."),
        None => Line::raw(format!(
            " every second from /v1/pools; rates over the last {RATE_WINDOW} s   q: quit"
        )),
    };
    frame.render_widget(line, status);
}

fn header(names: &[&str]) -> Row<'static> {
    let cells: Vec<Cell> = names.iter().map(|n| Cell::from(n.to_string())).collect();
    Row::new(cells).style(Style::new().add_modifier(Modifier::BOLD))
}

fn pool_table(screen: &Screen) -> Table<'static> {
    let mut rows = Vec::new();
    if let Some(reading) = &screen.reading {
        for (i, pool) in reading.sample.pools.iter().enumerate() {
            let rates = reading.rates.as_ref().and_then(|r| r.get(i)).map(|r| r.0);
            rows.push(pool_row(pool, rates));
        }
    }
    Table::new(rows, POOL_COLUMNS)
        .header(header(&[
            "pool",
            "bucket fill",
            "reserved",
            "chg/min",
            "flight",
            "queue",
            "adm/s",
            "rej/s",
            "thr/s",
        ]))
        .block(Block::bordered().title(" pools "))
}

fn pool_row(pool: &PoolSample, rates: Option<Rates>) -> Row<'static> {
    let c = &pool.counts;
    let queue = if pool.queue_depth == 0 {
        "0".to_string()
    } else {
        format!("{} {:.1}s", pool.queue_depth, pool.oldest_wait_secs)
    };
    let mut cells = vec![
        Cell::from(c.name.clone()),
        bucket(pool),
        Cell::from(compact(c.reserved as f64)),
        Cell::from(rates.map_or("-".into(), |r| compact(r.charged_per_minute))),
        Cell::from(format!("{}/{}", pool.in_flight, pool.max_concurrency)),
        Cell::from(queue),
    ];
    cells.extend(per_second(rates, |r| {
        [r.admitted, r.rejected, r.upstream_throttles]
    }));
    Row::new(cells)
}

/// The bucket's fill as a bar and a percentage, coloured by how full it is.
fn bucket(pool: &PoolSample) -> Cell<'static> {
    let Some(available) = pool.tokens_available else {
        return Cell::from("ledger down").style(Style::new().fg(Color::Red));
    };
    let fill = if pool.effective_tokens_per_minute == 0 {
        0.0
    } else {
        (available as f64 / pool.effective_tokens_per_minute as f64).clamp(0.0, 1.0)
    };
    let filled = (fill * BAR as f64).round() as usize;
    let colour = match fill {
        f if f < 0.1 => Color::Red,
        f if f < 0.3 => Color::Yellow,
        _ => Color::Green,
    };
    Cell::from(Line::from(vec![
        Span::styled("█".repeat(filled), Style::new().fg(colour)),
        Span::styled("░".repeat(BAR - filled), Style::new().fg(Color::DarkGray)),
        Span::raw(format!("{:>4.0}%", fill * 100.0)),
    ]))
}

fn route_table(screen: &Screen) -> Table<'static> {
    let mut rows = Vec::new();
    if let Some(reading) = &screen.reading {
        for (i, pool) in reading.sample.pools.iter().enumerate() {
            for (j, route) in pool.routes.iter().enumerate() {
                let rates = reading
                    .rates
                    .as_ref()
                    .and_then(|r| r.get(i))
                    .and_then(|r| r.1.get(j))
                    .copied();
                let mut cells = vec![
                    Cell::from(format!("{}/{}", pool.counts.name, route.name)),
                    Cell::from(compact(route.reserved as f64)),
                    Cell::from(rates.map_or("-".into(), |r| compact(r.charged_per_minute))),
                ];
                cells.extend(per_second(rates, |r| [r.admitted, r.rejected]));
                rows.push(Row::new(cells));
            }
        }
    }
    Table::new(rows, ROUTE_COLUMNS)
        .header(header(&[
            "pool/route",
            "reserved",
            "chg/min",
            "adm/s",
            "rej/s",
        ]))
        .block(Block::bordered().title(" routes "))
}

/// Rates to one decimal, or `-` before the second reading.
fn per_second<const N: usize>(
    rates: Option<Rates>,
    pick: impl Fn(Rates) -> [f64; N],
) -> Vec<Cell<'static>> {
    match rates {
        Some(r) => pick(r)
            .iter()
            .map(|v| Cell::from(format!("{v:.1}")))
            .collect(),
        None => (0..N).map(|_| Cell::from("-")).collect(),
    }
}

/// `950`, `12.5K`, `3.2M`.
pub fn compact(v: f64) -> String {
    match v {
        v if v >= 999_950.0 => format!("{:.1}M", v / 1e6),
        v if v >= 999.5 => format!("{:.1}K", v / 1e3),
        v => format!("{v:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use ratatui::{Terminal, backend::TestBackend};

    use super::*;
    use crate::top::{Reading, sample::parse};

    fn doc(admitted: u64) -> serde_json::Value {
        serde_json::json!({"ledger": "memory", "pools": [
            {"name": "sonnet4-us", "effective_tokens_per_minute": 200000, "max_concurrency": 32,
             "ledger": {"tokens_available": 150000, "reserved_tokens": 12500, "in_flight_requests": 7},
             "admitted": admitted, "upstream_throttles": 0, "rejected": {"tokens": 4},
             "queue": {"depth": 3, "oldest_wait_secs": 0.4},
             "routes": [{"name": "interactive", "reserved_tokens": 9000, "admitted": admitted,
                         "rejected": 4, "charged_tokens": admitted * 100}]},
            {"name": "haiku", "effective_tokens_per_minute": 100000, "max_concurrency": 4,
             "ledger": null, "admitted": 0, "upstream_throttles": 0, "rejected": {},
             "queue": {"depth": 0}, "routes": []}
        ]})
    }

    #[test]
    fn a_frame_fits_80_columns_and_shows_every_figure() {
        let t0 = Instant::now();
        let reading =
            Reading::first(parse(&doc(10), t0)).next(parse(&doc(30), t0 + Duration::from_secs(2)));
        let screen = Screen {
            url: "http://127.0.0.1:8080".into(),
            reading: Some(reading),
            error: None,
        };
        let mut terminal = Terminal::new(TestBackend::new(80, 24)).expect("terminal");
        terminal.draw(|f| render(f, &screen)).expect("draw");
        let text: Vec<String> = terminal
            .backend()
            .buffer()
            .content()
            .chunks(80)
            .map(|row| row.iter().map(|c| c.symbol()).collect())
            .collect();
        let all = text.join("\n");
        for needle in [
            "tokengate top",
            "ledger: memory",
            "sonnet4-us",
            "███████░░  75%",
            "12.5K",
            "60.0K",
            "7/32",
            "3 0.4s",
            "10.0",
            "haiku",
            "ledger down",
            "sonnet4-us/interactive",
            "9.0K",
        ] {
            assert!(all.contains(needle), "{needle:?} not on screen:\n{all}");
        }
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(compact(950.0), "950");
        assert_eq!(compact(12_500.0), "12.5K");
        assert_eq!(compact(3_200_000.0), "3.2M");
    }
}
