//! Plots of a run (`--plot FILE.svg` or `FILE.png`): latency against a count on log–log axes,
//! and throughput bars per operation and target.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (the `dejavu` crate) through
//! plotters' pure-Rust `ab_glyph` backend, so building and running need no fontconfig or
//! freetype. An SVG names the font family `sans-serif` and leaves drawing it to the viewer.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::bail;
use plotters::coord::Shift;
use plotters::prelude::*;

/// One line: points (x, y), both above 0 (the axes are logarithmic).
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of several lines, with its own title.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// Panels side by side sharing axis descriptions.
#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub panels: Vec<Panel>,
}

/// Bars: one group per name in `groups`, one bar per series in each group.
#[derive(Debug, Clone)]
pub struct BarChart {
    pub title: String,
    pub y_desc: String,
    pub groups: Vec<String>,
    /// (series name, one value per group; `None` draws no bar).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

/// Pixel size of one panel, and of the bar chart.
const PANEL_PX: (u32, u32) = (760, 560);
const BARS_PX: (u32, u32) = (1200, 600);
const FONT: &str = "sans-serif";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

fn format_of(path: &Path) -> anyhow::Result<Format> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Format::Svg),
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(Format::Png),
        _ => bail!(
            "--plot {}: the file name must end in .svg or .png",
            path.display()
        ),
    }
}

/// Fails early, before a run, on a plot file name that cannot be drawn.
pub fn check_path(path: &Path) -> anyhow::Result<()> {
    format_of(path).map(drop)
}

/// Registers the embedded font once per process.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    match ok {
        true => Ok(()),
        false => bail!("the embedded DejaVu Sans font could not be loaded"),
    }
}

fn drawing(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing the plot: {e}")
}

/// Draws `chart` into `path` (SVG or PNG by its extension).
pub fn lines(path: &Path, chart: &LineChart) -> anyhow::Result<()> {
    register_font()?;
    let panels = u32::try_from(chart.panels.len().max(1)).unwrap_or(1);
    let size = (PANEL_PX.0 * panels, PANEL_PX.1);
    match format_of(path)? {
        Format::Svg => draw_lines(&SVGBackend::new(path, size).into_drawing_area(), chart),
        Format::Png => draw_lines(&BitMapBackend::new(path, size).into_drawing_area(), chart),
    }
}

/// Draws `chart` into `path` (SVG or PNG by its extension).
pub fn bars(path: &Path, chart: &BarChart) -> anyhow::Result<()> {
    register_font()?;
    match format_of(path)? {
        Format::Svg => draw_bars(&SVGBackend::new(path, BARS_PX).into_drawing_area(), chart),
        Format::Png => draw_bars(
            &BitMapBackend::new(path, BARS_PX).into_drawing_area(),
            chart,
        ),
    }
}

/// A log axis's range around `values` (all above 0), with a margin on both sides.
fn log_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return 1.0..10.0;
    }
    (lo / 1.5)..(hi * 1.5)
}

/// A vertical log range with room for the legend above the data (a quarter of the span
/// more), so no line or bar runs under it.
fn with_legend_room(range: std::ops::Range<f64>) -> std::ops::Range<f64> {
    range.start..range.end * (range.end / range.start).powf(0.25)
}

/// `v` in few characters: 1k, 20k, 1.5M.
pub fn short(v: f64) -> String {
    let trim = |x: f64, unit: &str| {
        let s = format!("{x:.1}");
        format!("{}{unit}", s.trim_end_matches(".0"))
    };
    match v.abs() {
        a if a >= 1e6 => trim(v / 1e6, "M"),
        a if a >= 1e3 => trim(v / 1e3, "k"),
        a if a >= 1.0 || a == 0.0 => trim(v, ""),
        _ => format!("{v:.2}"),
    }
}

/// Series colors that stand out on white (matplotlib's "tab10").
const PALETTE: [(u8, u8, u8); 8] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
];

fn color(i: usize) -> RGBAColor {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b).to_rgba()
}

fn draw_lines<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &LineChart,
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(drawing)?;
    let body = root
        .titled(&chart.title, (FONT, 22).into_font())
        .map_err(drawing)?;
    let areas = body.split_evenly((1, chart.panels.len().max(1)));
    // One color per series name across panels, so "engine cold" looks the same everywhere.
    let mut names: Vec<&str> = Vec::new();
    for s in chart.panels.iter().flat_map(|p| &p.series) {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    for (area, panel) in areas.iter().zip(&chart.panels) {
        let points = || panel.series.iter().flat_map(|s| s.points.iter().copied());
        let x = log_range(points().map(|p| p.0));
        let y = with_legend_room(log_range(points().map(|p| p.1)));
        let mut c = ChartBuilder::on(area)
            .caption(&panel.title, (FONT, 17).into_font())
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d(x.log_scale(), y.log_scale())
            .map_err(drawing)?;
        c.configure_mesh()
            .x_desc(chart.x_desc.as_str())
            .y_desc(chart.y_desc.as_str())
            .x_label_formatter(&|v| short(*v))
            .y_label_formatter(&|v| short(*v))
            .label_style((FONT, 13).into_font())
            .draw()
            .map_err(drawing)?;
        for s in &panel.series {
            let i = names.iter().position(|n| *n == s.name).unwrap_or(0);
            let style = color(i).stroke_width(2);
            c.draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(drawing)?
                .label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], style));
            c.draw_series(
                s.points
                    .iter()
                    .map(|&p| Circle::new(p, 3, color(i).filled())),
            )
            .map_err(drawing)?;
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 13).into_font())
            .draw()
            .map_err(drawing)?;
    }
    root.present().map_err(drawing)?;
    Ok(())
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &BarChart,
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(drawing)?;
    let groups = chart.groups.len().max(1);
    let values = chart
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied());
    let y = with_legend_room(log_range(values));
    let floor = y.start;
    let mut c = ChartBuilder::on(root)
        .caption(&chart.title, (FONT, 22).into_font())
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5f64..(groups as f64 - 0.5), y.log_scale())
        .map_err(drawing)?;
    let names = chart.groups.clone();
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(groups)
        .x_label_formatter(&|v| {
            let i = v.round();
            match (v - i).abs() < 1e-6 && i >= 0.0 {
                true => names.get(i as usize).cloned().unwrap_or_default(),
                false => String::new(),
            }
        })
        .y_label_formatter(&|v| short(*v))
        .y_desc(chart.y_desc.as_str())
        .label_style((FONT, 13).into_font())
        .draw()
        .map_err(drawing)?;
    let width = 0.8 / chart.series.len().max(1) as f64;
    for (s, (name, per_group)) in chart.series.iter().enumerate() {
        let fill = color(s).filled();
        let bars = per_group.iter().enumerate().filter_map(|(g, v)| {
            let x0 = g as f64 - 0.4 + s as f64 * width;
            v.filter(|v| *v > 0.0)
                .map(|v| Rectangle::new([(x0, floor), (x0 + width * 0.92, v)], fill))
        });
        c.draw_series(bars)
            .map_err(drawing)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], fill));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 13).into_font())
        .draw()
        .map_err(drawing)?;
    root.present().map_err(drawing)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> LineChart {
        let series = |name: &str, k: f64| Series {
            name: name.into(),
            points: vec![(1.0, k), (1000.0, 2.0 * k), (1e6, 4.0 * k)],
        };
        LineChart {
            title: "t".into(),
            x_desc: "N".into(),
            y_desc: "µs".into(),
            panels: vec![
                Panel {
                    title: "by name".into(),
                    series: vec![series("local warm", 1.0), series("engine cold", 100.0)],
                },
                Panel {
                    title: "by gfid".into(),
                    series: vec![series("local warm", 2.0)],
                },
            ],
        }
    }

    #[test]
    fn lines_and_bars_are_drawn_as_svg_and_png() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bars_chart = BarChart {
            title: "ops".into(),
            y_desc: "ops/s".into(),
            groups: vec!["create".into(), "stat".into()],
            series: vec![
                ("local".into(), vec![Some(50_000.0), Some(500_000.0)]),
                ("engine".into(), vec![Some(5_000.0), None]),
            ],
        };
        let svg = dir.path().join("l.svg");
        lines(&svg, &chart()).expect("svg lines");
        let text = std::fs::read_to_string(&svg).expect("read svg");
        assert!(
            text.starts_with("<svg") && text.contains("engine cold"),
            "{text:.200}"
        );
        let png = dir.path().join("l.png");
        lines(&png, &chart()).expect("png lines");
        let bytes = std::fs::read(&png).expect("read png");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let svg = dir.path().join("b.svg");
        bars(&svg, &bars_chart).expect("svg bars");
        let text = std::fs::read_to_string(&svg).expect("read svg");
        assert!(
            text.contains("\ncreate\n") && text.contains("\nengine\n"),
            "{text:.400}"
        );
        bars(&dir.path().join("b.png"), &bars_chart).expect("png bars");
    }

    #[test]
    fn only_svg_and_png_are_accepted() {
        assert!(check_path(Path::new("a.SVG")).is_ok());
        assert!(check_path(Path::new("a.png")).is_ok());
        assert!(check_path(Path::new("a.pdf")).is_err());
        assert!(check_path(Path::new("a")).is_err());
    }

    #[test]
    fn short_numbers() {
        assert_eq!(short(1000.0), "1k");
        assert_eq!(short(2_000_000.0), "2M");
        assert_eq!(short(1500.0), "1.5k");
        assert_eq!(short(7.0), "7");
        assert_eq!(short(0.5), "0.50");
    }
}
