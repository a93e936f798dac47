//! Per-second timelines of an experiment, written as CSV and drawn as a PNG chart.
//!
//! The timeline figures of the DINOMO paper (figures 6, 7 and 8) show throughput and latency
//! second by second while the cluster reconfigures: a KN is added or removed, hot keys are
//! replicated, a KN fails and the system recovers. An experiment driver pushes one
//! [`TimelineRow`] per second and one [`Event`] per reconfiguration into a [`Timeline`], then
//! calls [`Timeline::write_csv`] (the data, so a figure can be redrawn or re-plotted elsewhere
//! without rerunning the experiment; [`Timeline::read_csv`] reads it back) and
//! [`Timeline::draw_png`] (a 1200x800 chart: throughput and the KN count on top, average and p99
//! latency on a log scale below, a dashed vertical line with its label at each event).
//!
//! # Text in the chart: no system package at build time
//!
//! plotters' `ttf` feature finds fonts through fontconfig/freetype, which needs system libraries
//! at build time. This crate instead enables plotters' pure-Rust `ab_glyph` feature, which knows
//! no font until one is registered at run time. [`chart_font`] registers the first readable font
//! among `$DINOMO_CHART_FONT` and a few standard paths ([`FONT_PATHS`], DejaVu Sans first: the
//! Debian/Ubuntu package `fonts-dejavu-core` provides it). No font is embedded in the binary.
//! If none is found, [`Timeline::draw_png`] still draws the chart, but with no text at all (no
//! title, tick labels, legend or event labels): the lines, the grid and the event markers remain.
//! That keeps a benchmark run from failing at its very end for want of a font; install
//! `fonts-dejavu-core` (or point `DINOMO_CHART_FONT` at a .ttf/.otf) for a readable chart.
//!
//! # Empty timelines
//!
//! Drawing a timeline with no row (or no row with a finite `second`) is an error, reported before
//! any file is created: an empty chart would look like a successful run that measured nothing.
//! [`Timeline::write_csv`] accepts an empty timeline (header-only files).

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context as _};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Header line of the rows file written by [`Timeline::write_csv`].
pub const CSV_HEADER: &str = "second,ops_per_sec,avg_latency_ms,p99_latency_ms,kns,errors";
/// Header line of the events file (`<stem>.events.csv`) written by [`Timeline::write_csv`].
pub const EVENTS_HEADER: &str = "second,label";
/// Size of the PNG drawn by [`Timeline::draw_png`], in pixels.
pub const PNG_SIZE: (u32, u32) = (1200, 800);
/// Environment variable naming a font file (.ttf/.otf) to use for the chart text; tried before
/// [`FONT_PATHS`].
pub const FONT_ENV: &str = "DINOMO_CHART_FONT";
/// Font files tried, in order, when `$DINOMO_CHART_FONT` is unset or unreadable.
pub const FONT_PATHS: &[&str] = &[
    // Debian/Ubuntu `fonts-dejavu-core`.
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    // Fedora `dejavu-sans-fonts`, Arch `ttf-dejavu`.
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    // Debian/Ubuntu `fonts-liberation`.
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    // macOS.
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// Family name the font is registered under; private to this module so that it cannot clash
/// with (or be replaced by) another registration of a common name like "sans-serif".
const FONT_FAMILY: &str = "dinomo-timeline-sans";

const THROUGHPUT_COLOR: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const KNS_COLOR: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
const AVG_COLOR: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
const P99_COLOR: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const ERROR_COLOR: RGBColor = RGBColor(0x94, 0x00, 0x94);
const EVENT_COLOR: RGBColor = RGBColor(0x40, 0x40, 0x40);
const FRAME_COLOR: RGBColor = RGBColor(0x80, 0x80, 0x80);

/// One second of an experiment.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TimelineRow {
    /// Seconds since the start of the experiment (end of the one-second window).
    pub second: f64,
    /// Operations completed in that second.
    pub ops_per_sec: f64,
    /// Mean latency of those operations, in milliseconds (0 or NaN when none completed).
    pub avg_latency_ms: f64,
    /// 99th percentile latency of those operations, in milliseconds.
    pub p99_latency_ms: f64,
    /// KNs serving at that second.
    pub kns: u32,
    /// Operations that failed in that second.
    pub errors: u64,
}

/// A reconfiguration of the system, drawn as a labelled vertical marker.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// When it happened, on the same clock as [`TimelineRow::second`].
    pub second: f64,
    /// Short text shown next to the marker, e.g. "KN added", "KN failed".
    pub label: String,
}

/// A per-second timeline of one experiment.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    /// Chart title.
    pub title: String,
    /// One row per second, in any order (drawing sorts them by `second`).
    pub rows: Vec<TimelineRow>,
    /// Reconfigurations, in any order.
    pub events: Vec<Event>,
}

impl Timeline {
    /// An empty timeline whose chart will carry `title`.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            rows: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Appends the measurements of one second.
    pub fn push(&mut self, row: TimelineRow) {
        self.rows.push(row);
    }

    /// Records a reconfiguration at `second`.
    pub fn event(&mut self, second: f64, label: impl Into<String>) {
        self.events.push(Event {
            second,
            label: label.into(),
        });
    }

    /// The events file that goes with the rows file `path`: `<stem>.events.csv` in the same
    /// directory (`fig7.csv` -> `fig7.events.csv`).
    pub fn events_path(path: &Path) -> PathBuf {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "timeline".to_owned());
        path.with_file_name(format!("{stem}.events.csv"))
    }

    /// Writes the rows to `path` (header [`CSV_HEADER`]) and the events to
    /// [`Timeline::events_path`] (header [`EVENTS_HEADER`]), in insertion order. The events file
    /// is written even when there is no event, so that a reader always finds both. Floats are
    /// written in Rust's shortest round-trip form, so [`Timeline::read_csv`] gets the exact
    /// values back. Labels are quoted as in RFC 4180 when they need it. The directory must exist.
    pub fn write_csv(&self, path: &Path) -> io::Result<()> {
        let mut out = String::with_capacity(64 * (self.rows.len() + 1));
        out.push_str(CSV_HEADER);
        out.push('\n');
        for r in &self.rows {
            // Writing to a String cannot fail.
            let _ = writeln!(
                out,
                "{},{},{},{},{},{}",
                r.second, r.ops_per_sec, r.avg_latency_ms, r.p99_latency_ms, r.kns, r.errors
            );
        }
        write_file(path, &out)?;

        let mut ev = String::from(EVENTS_HEADER);
        ev.push('\n');
        for e in &self.events {
            let _ = writeln!(ev, "{},{}", e.second, csv_field(&e.label));
        }
        write_file(&Self::events_path(path), &ev)
    }

    /// Reads back what [`Timeline::write_csv`] wrote to `path` (the events file is optional),
    /// e.g. to redraw a figure without rerunning the experiment. The title is not stored in the
    /// CSV, hence the argument.
    pub fn read_csv(path: &Path, title: impl Into<String>) -> anyhow::Result<Self> {
        let mut t = Self::new(title);
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let records = parse_csv(&text).with_context(|| format!("parsing {}", path.display()))?;
        check_header(&records, CSV_HEADER, path)?;
        for (i, rec) in records.iter().enumerate().skip(1) {
            let line = i + 1;
            let [second, ops, avg, p99, kns, errors] = rec.as_slice() else {
                bail!(
                    "{}:{line}: expected 6 fields, got {}",
                    path.display(),
                    rec.len()
                );
            };
            let f = |s: &str, what: &str| {
                s.parse::<f64>()
                    .with_context(|| format!("{}:{line}: bad {what} {s:?}", path.display()))
            };
            t.rows.push(TimelineRow {
                second: f(second, "second")?,
                ops_per_sec: f(ops, "ops_per_sec")?,
                avg_latency_ms: f(avg, "avg_latency_ms")?,
                p99_latency_ms: f(p99, "p99_latency_ms")?,
                kns: kns
                    .parse()
                    .with_context(|| format!("{}:{line}: bad kns {kns:?}", path.display()))?,
                errors: errors
                    .parse()
                    .with_context(|| format!("{}:{line}: bad errors {errors:?}", path.display()))?,
            });
        }

        let epath = Self::events_path(path);
        let text = match std::fs::read_to_string(&epath) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(t),
            Err(e) => return Err(e).with_context(|| format!("reading {}", epath.display())),
        };
        let records = parse_csv(&text).with_context(|| format!("parsing {}", epath.display()))?;
        check_header(&records, EVENTS_HEADER, &epath)?;
        for (i, rec) in records.iter().enumerate().skip(1) {
            let [second, label] = rec.as_slice() else {
                bail!(
                    "{}:{}: expected 2 fields, got {}",
                    epath.display(),
                    i + 1,
                    rec.len()
                );
            };
            let second = second
                .parse()
                .with_context(|| format!("{}:{}: bad second {second:?}", epath.display(), i + 1))?;
            t.event(second, label.clone());
        }
        Ok(t)
    }

    /// Draws the chart as a [`PNG_SIZE`] PNG at `path` (which should end in `.png`: the encoder
    /// picks the format from the extension). Top panel: throughput (left axis) and the KN count
    /// as a step line (right axis), plus a mark under each second that had errors. Bottom panel:
    /// average and p99 latency on a log scale; seconds without a positive latency (nothing
    /// completed) leave a gap. Every event is a dashed vertical line across both panels, labelled
    /// in the top one. See the module doc for what happens without a font, and for empty
    /// timelines.
    pub fn draw_png(&self, path: &Path) -> anyhow::Result<()> {
        // Checked before the backend exists: the bitmap backend writes its file when dropped,
        // and an error must not leave a blank PNG behind.
        self.plottable_rows()?;
        let font = chart_font().map(|_| FONT_FAMILY);
        let root = BitMapBackend::new(path, PNG_SIZE).into_drawing_area();
        self.render(&root, font)?;
        root.present()
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Rows with a finite `second`, sorted by it; an error if there is none.
    fn plottable_rows(&self) -> anyhow::Result<Vec<TimelineRow>> {
        let mut rows: Vec<TimelineRow> = self
            .rows
            .iter()
            .copied()
            .filter(|r| r.second.is_finite())
            .collect();
        if rows.is_empty() {
            bail!(
                "timeline {:?} has no row with a finite `second`: nothing to plot",
                self.title
            );
        }
        rows.sort_by(|a, b| a.second.total_cmp(&b.second));
        Ok(rows)
    }

    /// Draws the chart on `root`. `font` is the registered family to write text with; `None`
    /// draws no text at all (with the `ab_glyph` backend any text without a registered font is
    /// an error, so every text element is conditional on it).
    fn render<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        font: Option<&str>,
    ) -> anyhow::Result<()> {
        let rows = self.plottable_rows()?;
        let mut events: Vec<&Event> = self
            .events
            .iter()
            .filter(|e| e.second.is_finite())
            .collect();
        events.sort_by(|a, b| a.second.total_cmp(&b.second));
        let de =
            |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the timeline chart: {e}");
        let has_errors = rows.iter().any(|r| r.errors > 0);

        // The x range covers the events too, so that a marker after the last row still shows.
        let first = rows[0].second;
        let last = rows[rows.len() - 1].second;
        let (mut x0, mut x1) = events.iter().fold((first, last), |(lo, hi), e| {
            (lo.min(e.second), hi.max(e.second))
        });
        if x1 - x0 < 1e-9 {
            x0 -= 0.5;
            x1 += 0.5;
        }
        let x_fmt = |v: &f64| short_number(*v);

        root.fill(&WHITE).map_err(de)?;
        let body = match font {
            Some(f) => {
                let body = root
                    .titled(
                        &self.title,
                        (FontFamily::Name(f), 26).into_font().color(&BLACK),
                    )
                    .map_err(de)?;
                // One legend for both panels, in a strip of its own: inside a panel it would
                // hide data wherever it went (a failure dip, event labels, a latency spike).
                let (strip, body) = body.split_vertically(26);
                let mut entries = vec![
                    ("throughput (ops/s)", Sample::Line(THROUGHPUT_COLOR)),
                    ("KNs (right axis)", Sample::Line(KNS_COLOR)),
                ];
                if has_errors {
                    entries.push(("seconds with errors", Sample::Bar(ERROR_COLOR)));
                }
                entries.push(("average latency", Sample::Line(AVG_COLOR)));
                entries.push(("p99 latency", Sample::Line(P99_COLOR)));
                if !events.is_empty() {
                    entries.push(("reconfiguration", Sample::Dashed(EVENT_COLOR)));
                }
                draw_legend(&strip, f, &entries).map_err(de)?;
                body
            }
            None => root.margin(10, 0, 0, 0),
        };
        let (top, bottom) = body.split_vertically(body.dim_in_pixel().1 / 2);

        // ---- top panel: throughput and KNs ----
        let max_ops = rows
            .iter()
            .map(|r| r.ops_per_sec)
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        // Headroom above the highest point, for the event labels.
        let y_top = if max_ops > 0.0 { max_ops * 1.3 } else { 1.0 };
        let max_kns = rows.iter().map(|r| r.kns).max().unwrap_or(0);
        let mut builder = ChartBuilder::on(&top);
        builder.margin(10).margin_right(20);
        if font.is_some() {
            builder
                .x_label_area_size(30)
                .y_label_area_size(Y_LABEL_AREA)
                .right_y_label_area_size(RIGHT_LABEL_AREA);
        }
        let mut chart = builder
            .build_cartesian_2d(x0..x1, 0.0..y_top)
            .map_err(de)?
            .set_secondary_coord(x0..x1, 0u32..max_kns + 1);

        {
            let mut mesh = chart.configure_mesh();
            mesh.light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
                .bold_line_style(RGBColor(0xd8, 0xd8, 0xd8))
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&|v| si(*v));
            if let Some(f) = font {
                mesh.label_style((FontFamily::Name(f), 15))
                    .axis_desc_style((FontFamily::Name(f), 17))
                    .y_desc("throughput (ops/s)");
            }
            mesh.draw().map_err(de)?;
        }
        if let Some(f) = font {
            chart
                .configure_secondary_axes()
                .label_style((FontFamily::Name(f), 15))
                .axis_desc_style((FontFamily::Name(f), 17))
                .y_desc("KNs")
                .draw()
                .map_err(de)?;
        }

        if font.is_none() {
            // Without label areas there are no axis lines: frame the panel instead.
            chart
                .plotting_area()
                .draw(&Rectangle::new([(x0, 0.0), (x1, y_top)], FRAME_COLOR))
                .map_err(de)?;
        }

        let ops_style = THROUGHPUT_COLOR.stroke_width(2);
        for seg in segments(&rows, |r| Some(r.ops_per_sec).filter(|v| v.is_finite())) {
            chart
                .draw_series(LineSeries::new(seg, ops_style))
                .map_err(de)?;
        }

        // A step line: the KN count holds from one second until the next row.
        let mut steps: Vec<(f64, u32)> = Vec::with_capacity(rows.len() * 2);
        for w in rows.windows(2) {
            steps.push((w[0].second, w[0].kns));
            steps.push((w[1].second, w[0].kns));
        }
        steps.push((last, rows[rows.len() - 1].kns));
        chart
            .draw_secondary_series(LineSeries::new(steps, KNS_COLOR.stroke_width(2)))
            .map_err(de)?;

        // Errors: a short bar at the bottom of the panel under each second that had any, so a
        // failure window is visible even when throughput merely dips.
        if has_errors {
            let h = y_top * 0.04;
            let bar = ERROR_COLOR.stroke_width(3);
            chart
                .draw_series(
                    rows.iter()
                        .filter(|r| r.errors > 0)
                        .map(|r| PathElement::new([(r.second, 0.0), (r.second, h)], bar)),
                )
                .map_err(de)?;
        }

        let event_style = EVENT_COLOR.stroke_width(1);
        for e in &events {
            chart
                .draw_series(DashedLineSeries::new(
                    [(e.second, 0.0), (e.second, y_top)],
                    6,
                    4,
                    event_style,
                ))
                .map_err(de)?;
        }
        if let Some(f) = font {
            let style = (FontFamily::Name(f), 14).into_font().color(&BLACK);
            let area = chart.plotting_area();
            let (px_range, _) = area.get_pixel_range();
            for (i, e) in events.iter().enumerate() {
                // Three staggered rows, so that labels of events a few seconds apart do not
                // overprint each other.
                let dy = 4 + (i % 3) as i32 * 20;
                let (w, h) = area.estimate_text_size(&e.label, &style).map_err(de)?;
                let (w, h) = (w as i32, h as i32);
                let (px, _) = area.map_coordinate(&(e.second, y_top));
                // Right of the line, unless that would run off the panel.
                let dx = if px + 4 + w + 4 > px_range.end {
                    -(w + 6)
                } else {
                    4
                };
                area.draw(
                    &(EmptyElement::at((e.second, y_top))
                        + Rectangle::new(
                            [(dx - 2, dy - 1), (dx + w + 2, dy + h + 3)],
                            WHITE.mix(0.85).filled(),
                        )
                        + Text::new(e.label.clone(), (dx, dy), style.clone())),
                )
                .map_err(de)?;
            }
        }

        // ---- bottom panel: latency ----
        let positive = |v: f64| Some(v).filter(|v| v.is_finite() && *v > 0.0);
        let (lo, hi) = rows
            .iter()
            .flat_map(|r| [r.avg_latency_ms, r.p99_latency_ms])
            .filter_map(positive)
            .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let (lo, hi) = log_range(lo, hi);
        let mut builder = ChartBuilder::on(&bottom);
        builder.margin(10).margin_right(20);
        if font.is_some() {
            // No right label area (nothing to label there: a mirrored axis would repeat the left
            // one) but as wide a margin, so that both panels' time axes line up.
            builder
                .x_label_area_size(45)
                .y_label_area_size(Y_LABEL_AREA)
                .margin_right(20 + RIGHT_LABEL_AREA);
        }
        let mut lat = builder
            .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
            .map_err(de)?;
        {
            let mut mesh = lat.configure_mesh();
            // Ask for many key points, so that the log axis has a grid line at every 1..9 x 10^k;
            // the formatter then labels only 1, 2 and 5 x 10^k, which is what stays readable.
            // No light lines: between the 1..9 x 10^k lines they would only make grey bands.
            mesh.light_line_style(TRANSPARENT)
                .bold_line_style(RGBColor(0xd8, 0xd8, 0xd8))
                .y_labels(40)
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&|v| log_tick(*v));
            if let Some(f) = font {
                mesh.label_style((FontFamily::Name(f), 15))
                    .axis_desc_style((FontFamily::Name(f), 17))
                    .x_desc("time (s)")
                    .y_desc("latency (ms, log scale)");
            }
            mesh.draw().map_err(de)?;
        }
        if font.is_none() {
            lat.plotting_area()
                .draw(&Rectangle::new([(x0, lo), (x1, hi)], FRAME_COLOR))
                .map_err(de)?;
        }
        for (color, get) in [
            (
                AVG_COLOR,
                (|r: &TimelineRow| r.avg_latency_ms) as fn(&TimelineRow) -> f64,
            ),
            (P99_COLOR, |r: &TimelineRow| r.p99_latency_ms),
        ] {
            for seg in segments(&rows, |r| positive(get(r))) {
                lat.draw_series(LineSeries::new(seg, color.stroke_width(2)))
                    .map_err(de)?;
            }
        }
        for e in &events {
            lat.draw_series(DashedLineSeries::new(
                [(e.second, lo), (e.second, hi)],
                6,
                4,
                event_style,
            ))
            .map_err(de)?;
        }
        Ok(())
    }
}

/// Width of the left axis label area (tick labels and the rotated axis name), in pixels.
const Y_LABEL_AREA: i32 = 70;
/// Width of the right axis label area of the top panel (the KN count), in pixels.
const RIGHT_LABEL_AREA: i32 = 55;

/// What a legend entry shows next to its text.
#[derive(Debug, Clone, Copy)]
enum Sample {
    Line(RGBColor),
    Bar(RGBColor),
    Dashed(RGBColor),
}

/// Draws the legend entries in one centred row across `strip`.
fn draw_legend<DB: DrawingBackend>(
    strip: &DrawingArea<DB, Shift>,
    family: &str,
    entries: &[(&str, Sample)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    const SAMPLE_W: i32 = 24;
    const GAP: i32 = 8;
    const SPACING: i32 = 28;
    let style = (FontFamily::Name(family), 15)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let mut widths = Vec::with_capacity(entries.len());
    for (text, _) in entries {
        widths.push(strip.estimate_text_size(text, &style)?.0 as i32);
    }
    let total: i32 = widths.iter().map(|w| SAMPLE_W + GAP + w).sum::<i32>()
        + SPACING * (entries.len() as i32 - 1);
    let (w, h) = strip.dim_in_pixel();
    let mut x = ((w as i32 - total) / 2).max(0);
    let y = h as i32 / 2;
    for ((text, sample), tw) in entries.iter().zip(widths) {
        match *sample {
            Sample::Line(c) => strip.draw(&PathElement::new(
                [(x, y), (x + SAMPLE_W, y)],
                c.stroke_width(2),
            ))?,
            Sample::Bar(c) => {
                let mid = x + SAMPLE_W / 2;
                strip.draw(&PathElement::new(
                    [(mid, y - 6), (mid, y + 6)],
                    c.stroke_width(3),
                ))?
            }
            Sample::Dashed(c) => {
                // Vertical, like the markers themselves.
                let mid = x + SAMPLE_W / 2;
                strip.draw(&DashedPathElement::new(
                    [(mid, y - 9), (mid, y + 9)],
                    4,
                    3,
                    c.stroke_width(1),
                ))?
            }
        }
        strip.draw(&Text::new(*text, (x + SAMPLE_W + GAP, y), style.clone()))?;
        x += SAMPLE_W + GAP + tw + SPACING;
    }
    Ok(())
}

/// Bounds of the log latency axis. The lower bound is a power of ten because plotters puts log
/// ticks at powers of ten and their multiples counting up from the first power of ten in the
/// range: values below it would get no tick at all. The upper bound is the next 1, 2 or 5 x 10^k,
/// which wastes less height than a whole decade.
fn log_range(lo: f64, hi: f64) -> (f64, f64) {
    if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && hi >= lo) {
        // Nothing positive to show: an arbitrary decade, so that the axes can still be drawn.
        return (0.1 * (1.0 - 1e-9), 1.0);
    }
    let decade = |v: f64| 10f64.powi(v.log10().floor() as i32);
    // A hair below the power of ten, so that rounding in plotters' `ceil(ln(lo) / ln(10))`
    // cannot skip the first tick.
    let lo_axis = decade(lo) * (1.0 - 1e-9);
    let d = decade(hi);
    let hi_axis = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * d)
        .find(|v| *v >= hi * (1.0 - 1e-12))
        .unwrap_or(10.0 * d);
    (lo_axis, hi_axis.max(lo_axis * 2.0))
}

/// Label of a log-axis tick: shown only at 1, 2 and 5 x 10^k, blank elsewhere.
fn log_tick(v: f64) -> String {
    if !(v.is_finite() && v > 0.0) {
        return String::new();
    }
    let mantissa = v / 10f64.powf(v.log10().floor());
    if [1.0, 2.0, 5.0, 10.0]
        .iter()
        .any(|m| (mantissa - m).abs() < 1e-6 * m)
    {
        short_number(v)
    } else {
        String::new()
    }
}

/// The font file used for chart text, registered with plotters on first call; `None` if none of
/// `$DINOMO_CHART_FONT` and [`FONT_PATHS`] is a readable font (charts are then drawn without
/// text). The lookup happens once per process.
pub fn chart_font() -> Option<&'static Path> {
    static FONT: OnceLock<Option<PathBuf>> = OnceLock::new();
    FONT.get_or_init(|| {
        let from_env = std::env::var_os(FONT_ENV).map(PathBuf::from);
        for path in from_env
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
        {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            // plotters keeps a `&'static` reference to the font data: leak it. This happens once
            // per process (a few hundred KB), plus once per file that turns out not to be a font.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes).is_ok() {
                return Some(path);
            }
        }
        None
    })
    .as_deref()
}

/// Splits `rows` into runs of consecutive rows for which `value` is `Some`, as (second, value)
/// points: a line is drawn within a run, a gap is left between runs.
fn segments(
    rows: &[TimelineRow],
    value: impl Fn(&TimelineRow) -> Option<f64>,
) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut cur = Vec::new();
    for r in rows {
        match value(r) {
            Some(v) => cur.push((r.second, v)),
            None if !cur.is_empty() => out.push(std::mem::take(&mut cur)),
            None => {}
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Tick label for a throughput: 0, 950, 12k, 1.5M.
fn si(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{}G", short_number(v / 1e9))
    } else if a >= 1e6 {
        format!("{}M", short_number(v / 1e6))
    } else if a >= 1e3 {
        format!("{}k", short_number(v / 1e3))
    } else {
        short_number(v)
    }
}

/// At most three significant digits, no trailing zeros: 0.05, 1.5, 120. Tick values come out of
/// float arithmetic (0.30000000000000004), so they must be rounded to be readable.
fn short_number(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = v.abs().log10().floor() as i32;
    let decimals = (2 - digits).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

fn write_file(path: &Path, text: &str) -> io::Result<()> {
    let mut f = io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(text.as_bytes())?;
    f.flush()
}

/// `s` as one CSV field: quoted (with inner quotes doubled) only when it has to be.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) || s.trim() != s {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// A minimal RFC 4180 reader: records of fields, quoted fields may hold commas, doubled quotes
/// and line breaks. Enough for the files [`Timeline::write_csv`] writes.
fn parse_csv(text: &str) -> anyhow::Result<Vec<Vec<String>>> {
    let mut records = Vec::new();
    let mut record = Vec::new();
    let mut field = String::new();
    let mut chars = text.chars().peekable();
    let mut quoted = false;
    // Whether the current record has anything yet, so that a final newline does not make an
    // empty record.
    let mut started = false;
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => quoted = false,
                c => field.push(c),
            }
            continue;
        }
        match c {
            '"' if field.is_empty() => {
                quoted = true;
                started = true;
            }
            ',' => {
                record.push(std::mem::take(&mut field));
                started = true;
            }
            '\r' if chars.peek() == Some(&'\n') => {}
            '\n' => {
                if started {
                    record.push(std::mem::take(&mut field));
                    records.push(std::mem::take(&mut record));
                }
                started = false;
            }
            c => {
                field.push(c);
                started = true;
            }
        }
    }
    if quoted {
        bail!("unterminated quoted field");
    }
    if started {
        record.push(field);
        records.push(record);
    }
    Ok(records)
}

fn check_header(records: &[Vec<String>], header: &str, path: &Path) -> anyhow::Result<()> {
    let found = records.first().map(|r| r.join(",")).unwrap_or_default();
    if found != header {
        bail!(
            "{}: expected header {header:?}, found {found:?}",
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run shaped like figure 7 of the paper: scale out under load, replicate hot keys, scale
    /// back in; then a failure and recovery as in figure 8.
    fn sample() -> Timeline {
        let mut t = Timeline::new("YCSB-A, Zipf 0.99: elasticity and failure (sample data)");
        for s in 1..=120u32 {
            let sec = f64::from(s);
            let kns = match s {
                0..=29 => 2,
                30..=79 => 3,
                _ => 2,
            };
            let (mut ops, mut avg) = match s {
                0..=29 => (410_000.0, 0.45),
                30..=34 => (300_000.0 + f64::from(s - 30) * 40_000.0, 0.9),
                35..=49 => (560_000.0, 0.38),
                50..=79 => (640_000.0, 0.31),
                _ => (600_000.0, 0.34),
            };
            let mut errors = 0;
            if (95..=98).contains(&s) {
                // KN failed at 95 s: no completions for a few seconds.
                ops = if s == 95 { 90_000.0 } else { 0.0 };
                avg = if s == 95 { 4.0 } else { 0.0 };
                errors = 1500;
            }
            let wobble = (sec * 0.7).sin() * 0.03;
            t.push(TimelineRow {
                second: sec,
                ops_per_sec: ops * (1.0 + wobble),
                avg_latency_ms: avg * (1.0 - wobble),
                p99_latency_ms: avg * 4.5 * (1.0 + 2.0 * wobble),
                kns: if (95..=104).contains(&s) { 1 } else { kns },
                errors,
            });
        }
        t.event(30.0, "KN added");
        t.event(50.0, "keys replicated");
        t.event(80.0, "KN removed");
        t.event(95.0, "KN failed");
        t.event(105.0, "recovered");
        t
    }

    /// IHDR width and height of a PNG file, after checking the signature and the chunk type.
    fn png_dimensions(bytes: &[u8]) -> (u32, u32) {
        assert!(
            bytes.len() > 33,
            "too short for a PNG: {} bytes",
            bytes.len()
        );
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR", "first chunk must be IHDR");
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        assert!(
            bytes.ends_with(b"IEND\xae\x42\x60\x82"),
            "PNG must end with IEND"
        );
        (be(&bytes[16..20]), be(&bytes[20..24]))
    }

    /// Renders into an RGB buffer of [`PNG_SIZE`].
    fn render_buffer(t: &Timeline, font: Option<&str>) -> anyhow::Result<Vec<u8>> {
        let (w, h) = PNG_SIZE;
        let mut buf = vec![0u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, PNG_SIZE).into_drawing_area();
            t.render(&root, font)?;
            root.present()?;
        }
        Ok(buf)
    }

    fn count_color(buf: &[u8], c: RGBColor) -> usize {
        buf.chunks_exact(3)
            .filter(|p| p[0] == c.0 && p[1] == c.1 && p[2] == c.2)
            .count()
    }

    #[test]
    fn csv_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fig6.csv");
        let mut t = Timeline::new("t");
        t.push(TimelineRow {
            second: 1.0,
            ops_per_sec: 123_456.789,
            avg_latency_ms: 0.1,
            p99_latency_ms: 1e-7,
            kns: 4,
            errors: 0,
        });
        t.push(TimelineRow {
            second: 2.5,
            ops_per_sec: 0.0,
            avg_latency_ms: 1.0 / 3.0,
            p99_latency_ms: 12.0,
            kns: 0,
            errors: u64::MAX,
        });
        t.write_csv(&path).unwrap();

        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], CSV_HEADER);
        assert_eq!(
            lines[0],
            "second,ops_per_sec,avg_latency_ms,p99_latency_ms,kns,errors"
        );
        assert_eq!(lines[1], "1,123456.789,0.1,0.0000001,4,0");
        assert_eq!(lines.len(), 3);
        let f: Vec<&str> = lines[2].split(',').collect();
        assert_eq!(f[0].parse::<f64>().unwrap(), 2.5);
        assert_eq!(f[3].parse::<f64>().unwrap(), 12.0);
        assert_eq!(f[5], u64::MAX.to_string());

        let back = Timeline::read_csv(&path, "t").unwrap();
        // Exact equality: the written floats round-trip bit for bit.
        assert_eq!(back, t);
        assert_eq!(
            back.rows[1].avg_latency_ms.to_bits(),
            (1.0f64 / 3.0).to_bits()
        );
    }

    #[test]
    fn events_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fig7.csv");
        assert_eq!(
            Timeline::events_path(&path),
            dir.path().join("fig7.events.csv")
        );

        let mut t = Timeline::new("t");
        t.push(TimelineRow::default());
        t.event(30.0, "KN added");
        t.event(12.25, "keys replicated, 3 \"hot\" keys");
        t.write_csv(&path).unwrap();

        let text = std::fs::read_to_string(dir.path().join("fig7.events.csv")).unwrap();
        assert_eq!(
            text,
            "second,label\n30,KN added\n12.25,\"keys replicated, 3 \"\"hot\"\" keys\"\n"
        );
        let back = Timeline::read_csv(&path, "t").unwrap();
        assert_eq!(back.events, t.events);

        // No events: the file still exists, header only.
        let path2 = dir.path().join("quiet.csv");
        Timeline::new("q").write_csv(&path2).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("quiet.events.csv")).unwrap(),
            "second,label\n"
        );
        assert_eq!(
            std::fs::read_to_string(&path2).unwrap(),
            format!("{CSV_HEADER}\n")
        );
    }

    #[test]
    fn read_csv_rejects_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.csv");
        std::fs::write(&path, "second,ops\n1,2\n").unwrap();
        let err = Timeline::read_csv(&path, "t").unwrap_err().to_string();
        assert!(err.contains("expected header"), "{err}");
        std::fs::write(&path, format!("{CSV_HEADER}\n1,2,3,4,x,0\n")).unwrap();
        let err = format!("{:#}", Timeline::read_csv(&path, "t").unwrap_err());
        assert!(err.contains("bad kns"), "{err}");
    }

    #[test]
    fn png_is_valid_1200x800() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fig.png");
        let t = sample();
        t.draw_png(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(png_dimensions(&bytes), (1200, 800));
        assert!(
            bytes.len() > 20_000,
            "suspiciously small PNG: {} bytes",
            bytes.len()
        );

        // Kept for looking at: DINOMO_TIMELINE_SAMPLE=/tmp/timeline-sample.png cargo test ...
        if let Some(out) = std::env::var_os("DINOMO_TIMELINE_SAMPLE") {
            std::fs::copy(&path, out).unwrap();
        }
    }

    #[test]
    fn chart_draws_every_series() {
        let t = sample();
        let buf = render_buffer(&t, chart_font().map(|_| FONT_FAMILY)).unwrap();
        for (name, c) in [
            ("throughput", THROUGHPUT_COLOR),
            ("KNs", KNS_COLOR),
            ("avg latency", AVG_COLOR),
            ("p99 latency", P99_COLOR),
            ("errors", ERROR_COLOR),
            ("events", EVENT_COLOR),
        ] {
            let n = count_color(&buf, c);
            assert!(n > 200, "{name}: only {n} pixels of its color");
        }
    }

    #[test]
    fn chart_without_font_has_lines_and_no_text() {
        // With `None` no text may be drawn: any attempt would fail, as the ab_glyph backend has
        // no font under the default family names.
        let t = sample();
        let no_text = render_buffer(&t, None).unwrap();
        assert!(count_color(&no_text, THROUGHPUT_COLOR) > 200);
        assert!(count_color(&no_text, P99_COLOR) > 200);
        assert!(count_color(&no_text, EVENT_COLOR) > 200);

        if chart_font().is_some() {
            // The title band is white without text and has dark pixels with it.
            let dark = |buf: &[u8]| {
                buf[..(PNG_SIZE.0 * 30 * 3) as usize]
                    .chunks_exact(3)
                    // The event markers reach into the band and are dark too.
                    .filter(|p| p.iter().all(|&v| v < 100) && p != &[0x40, 0x40, 0x40])
                    .count()
            };
            assert_eq!(dark(&no_text), 0);
            let text = render_buffer(&t, Some(FONT_FAMILY)).unwrap();
            assert!(
                dark(&text) > 100,
                "title not drawn: {} dark pixels",
                dark(&text)
            );
        }
    }

    #[test]
    fn empty_timeline_is_an_error_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.png");
        let mut t = Timeline::new("empty run");
        t.event(3.0, "KN added");
        let err = t.draw_png(&path).unwrap_err().to_string();
        assert!(
            err.contains("nothing to plot") && err.contains("empty run"),
            "{err}"
        );
        assert!(!path.exists());

        t.push(TimelineRow {
            second: f64::NAN,
            ..TimelineRow::default()
        });
        assert!(t.draw_png(&path).is_err());
        assert!(!path.exists());
    }

    #[test]
    fn degenerate_timelines_draw() {
        let dir = tempfile::tempdir().unwrap();
        // One row, zero throughput, no latency at all, an event on that very second.
        let mut t = Timeline::new("one second");
        t.push(TimelineRow {
            second: 5.0,
            kns: 1,
            ..TimelineRow::default()
        });
        t.event(5.0, "KN failed");
        let path = dir.path().join("one.png");
        t.draw_png(&path).unwrap();
        assert_eq!(png_dimensions(&std::fs::read(&path).unwrap()), (1200, 800));
        render_buffer(&t, None).unwrap();
    }

    #[test]
    fn segments_leave_gaps() {
        let rows: Vec<TimelineRow> = [1.0, 0.0, 2.0, 3.0, f64::NAN, 0.0]
            .iter()
            .enumerate()
            .map(|(i, &v)| TimelineRow {
                second: i as f64,
                avg_latency_ms: v,
                ..TimelineRow::default()
            })
            .collect();
        let segs = segments(&rows, |r| {
            Some(r.avg_latency_ms).filter(|v| v.is_finite() && *v > 0.0)
        });
        assert_eq!(segs, vec![vec![(0.0, 1.0)], vec![(2.0, 2.0), (3.0, 3.0)]]);
    }

    #[test]
    fn log_axis_range_and_ticks() {
        let close = |(a, b): (f64, f64), (c, d): (f64, f64)| {
            assert!(
                (a - c).abs() < 1e-6 * c && (b - d).abs() < 1e-6 * d,
                "{a}..{b} vs {c}..{d}"
            )
        };
        close(log_range(0.3, 18.0), (0.1, 20.0));
        close(log_range(0.05, 0.5), (0.01, 0.5));
        close(log_range(1.0, 1.0), (1.0, 2.0));
        close(log_range(2.0, 30.0), (1.0, 50.0));
        close(log_range(2.0, 60.0), (1.0, 100.0));
        assert!(log_range(0.3, 18.0).0 <= 0.1);
        close(log_range(f64::INFINITY, 0.0), (0.1, 1.0));
        assert_eq!(log_tick(0.2), "0.2");
        assert_eq!(log_tick(50.00000000000001), "50");
        assert_eq!(log_tick(100.0), "100");
        assert_eq!(log_tick(0.30000000000000004), "");
        assert_eq!(log_tick(7.0), "");
    }

    #[test]
    fn number_labels() {
        assert_eq!(si(0.0), "0");
        assert_eq!(si(950.0), "950");
        assert_eq!(si(12_000.0), "12k");
        assert_eq!(si(1_500_000.0), "1.5M");
        assert_eq!(short_number(0.30000000000000004), "0.3");
        assert_eq!(short_number(0.05), "0.05");
        assert_eq!(short_number(120.0), "120");
        assert_eq!(short_number(1.25), "1.25");
    }
}
