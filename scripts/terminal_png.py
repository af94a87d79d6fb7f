#!/usr/bin/env python3
"""Turns a terminal screen captured by tmux into a PNG: the README's picture of `tokengate top`.

    tmux new-session -d -s top -x 80 -y 24 'tokengate top --url http://127.0.0.1:8080'
    tmux capture-pane -e -p -t top > top.ansi          # the screen, with its colours
    scripts/terminal_png.py top.ansi docs/top.png

The capture's SGR colours (the 16 basic ones, 256-colour and true-colour) become an HTML page in
a monospace font, which headless Chromium (Debian package `chromium`) renders to the PNG. Nothing
is fetched from the network.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BASIC = ["#1e1e1e", "#cd3131", "#0dbc79", "#e5e510", "#2472c8", "#bc3fbc", "#11a8cd", "#e5e5e5"]
BRIGHT = ["#666666", "#f14c4c", "#23d18b", "#f5f543", "#3b8eea", "#d670d6", "#29b8db", "#ffffff"]
FOREGROUND, BACKGROUND = "#d4d4d4", "#1e1e1e"
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def colour_256(n: int) -> str:
    if n < 8:
        return BASIC[n]
    if n < 16:
        return BRIGHT[n - 8]
    if n < 232:
        n -= 16
        steps = [0, 95, 135, 175, 215, 255]
        return "#%02x%02x%02x" % (steps[n // 36], steps[n // 6 % 6], steps[n % 6])
    grey = 8 + (n - 232) * 10
    return "#%02x%02x%02x" % (grey, grey, grey)


def apply(codes: list[int], style: dict) -> None:
    """Applies one SGR sequence to `style` (fg, bg, bold, reverse)."""
    i = 0
    while i < len(codes):
        c = codes[i]
        if c == 0:
            style.clear()
        elif c == 1:
            style["bold"] = True
        elif c == 22:
            style.pop("bold", None)
        elif c == 7:
            style["reverse"] = True
        elif c == 27:
            style.pop("reverse", None)
        elif 30 <= c <= 37:
            style["fg"] = BASIC[c - 30]
        elif 90 <= c <= 97:
            style["fg"] = BRIGHT[c - 90]
        elif 40 <= c <= 47:
            style["bg"] = BASIC[c - 40]
        elif 100 <= c <= 107:
            style["bg"] = BRIGHT[c - 100]
        elif c == 39:
            style.pop("fg", None)
        elif c == 49:
            style.pop("bg", None)
        elif c in (38, 48) and i + 1 < len(codes):
            key = "fg" if c == 38 else "bg"
            if codes[i + 1] == 5 and i + 2 < len(codes):
                style[key] = colour_256(codes[i + 2])
                i += 2
            elif codes[i + 1] == 2 and i + 4 < len(codes):
                style[key] = "#%02x%02x%02x" % tuple(codes[i + 2 : i + 5])
                i += 4
        i += 1


def to_html(text: str) -> str:
    out, style = [], {}
    for line in text.rstrip("\n").split("\n"):
        pos = 0
        for m in list(SGR.finditer(line)) + [None]:
            chunk = line[pos : m.start() if m else len(line)]
            if chunk:
                fg, bg = style.get("fg", FOREGROUND), style.get("bg", BACKGROUND)
                if style.get("reverse"):
                    fg, bg = bg, fg
                weight = "bold" if style.get("bold") else "normal"
                out.append(
                    f'<span style="color:{fg};background:{bg};font-weight:{weight}">'
                    f"{html.escape(chunk)}</span>"
                )
            if m:
                apply([int(c) if c else 0 for c in m.group(1).split(";")], style)
                pos = m.end()
        out.append("\n")
    return (
        "<!doctype html><meta charset=utf-8><style>"
        f"body{{margin:0;background:{BACKGROUND}}}"
        "pre{margin:12px;font:15px/1.17 'DejaVu Sans Mono',monospace}"
        f"</style><pre style='color:{FOREGROUND}'>{''.join(out)}</pre>"
    )


def main() -> None:
    capture, png = Path(sys.argv[1]), Path(sys.argv[2])
    text = capture.read_text()
    rows = text.rstrip("\n").count("\n") + 1
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "screen.html"
        page.write_text(to_html(text))
        # 80 columns of 15px DejaVu Sans Mono (about 9.04 px each) plus the margins.
        width, height = 80 * 9 + 44, int(rows * 15 * 1.17) + 28
        subprocess.run(
            [
                "chromium", "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
                f"--screenshot={png.resolve()}", page.as_uri(),
            ],
            check=True,
            capture_output=True,
        )


if __name__ == "__main__":
    main()
