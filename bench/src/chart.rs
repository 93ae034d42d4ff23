//! PNG charts (plotters, bitmap backend): lines on log scales, and horizontal bars.

use std::path::Path;

use anyhow::{Context, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Fonts tried in order; charts need one (Debian: `apt-get install fonts-dejavu-core`).
const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a system font as plotters' `sans-serif`.
pub fn init_fonts() -> anyhow::Result<()> {
    let path = FONTS
        .iter()
        .find(|p| Path::new(p).exists())
        .context("no TrueType font found for the charts: apt-get install fonts-dejavu-core")?;
    let bytes: &'static [u8] = Vec::leak(std::fs::read(path)?);
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{path} is not a usable font"))?;
    Ok(())
}

fn pe<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e:?}")
}

/// One line: a name and its (x, y) points.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Color.
    pub color: RGBColor,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
}

/// A line chart; `x` is drawn on a log2 axis labelled by `x_label_of`, `y` on a log10 axis.
pub struct LineChart<'a> {
    /// Title.
    pub title: &'a str,
    /// X axis description (with unit).
    pub x_desc: &'a str,
    /// Y axis description (with unit).
    pub y_desc: &'a str,
    /// X tick label from an x value.
    pub x_label_of: &'a dyn Fn(f64) -> String,
    /// The lines.
    pub series: Vec<Series>,
}

fn canvas(path: &Path) -> DrawingArea<BitMapBackend<'_>, Shift> {
    BitMapBackend::new(path, (1100, 700)).into_drawing_area()
}

fn y_label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else if v >= 0.01 {
        format!("{v:.2}")
    } else {
        format!("{v:.0e}")
    }
}

impl LineChart<'_> {
    /// Draws the chart into `path`.
    pub fn draw(&self, path: &Path) -> anyhow::Result<()> {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts {
            x0 = x0.min(x);
            x1 = x1.max(x);
            if y > 0.0 {
                y0 = y0.min(y);
                y1 = y1.max(y);
            }
        }
        anyhow::ensure!(x0 <= x1 && y0 <= y1, "nothing to draw in {}", self.title);
        let (lx0, lx1) = (x0.log2(), x1.log2().max(x0.log2() + 1.0));
        let root = canvas(path);
        root.fill(&WHITE).map_err(pe)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(self.title, ("sans-serif", 26))
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(80)
            .build_cartesian_2d((lx0 - 0.15)..(lx1 + 0.15), (y0 / 2.0..y1 * 2.0).log_scale())
            .map_err(pe)?;
        let ticks = (lx1 - lx0).round() as usize + 1;
        chart
            .configure_mesh()
            .x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .x_labels(ticks)
            .x_label_formatter(&|v| {
                let r = v.round();
                if (v - r).abs() < 1e-6 {
                    (self.x_label_of)(r.exp2())
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| y_label(*v))
            .label_style(("sans-serif", 16))
            .axis_desc_style(("sans-serif", 18))
            .draw()
            .map_err(pe)?;
        for s in &self.series {
            let c = s.color;
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|p| p.1 > 0.0)
                .map(|&(x, y)| (x.log2(), y))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(3)))
                .map_err(pe)?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, c.filled())))
                .map_err(pe)?;
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(pe)?;
        root.present().map_err(pe)?;
        Ok(())
    }
}

/// A horizontal bar chart on a log10 value axis; each bar is (label, value, color).
pub fn bars(
    path: &Path,
    title: &str,
    value_desc: &str,
    bars: &[(String, f64, RGBColor)],
) -> anyhow::Result<()> {
    let vmax = bars.iter().map(|b| b.1).fold(f64::MIN, f64::max);
    let vmin = bars
        .iter()
        .map(|b| b.1)
        .filter(|v| *v > 0.0)
        .fold(f64::MAX, f64::min);
    anyhow::ensure!(vmax > 0.0, "nothing to draw in {title}");
    let lo = vmin / 4.0;
    let root = canvas(path);
    root.fill(&WHITE).map_err(pe)?;
    let n = bars.len() as u32;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(330)
        .build_cartesian_2d((lo..vmax * 6.0).log_scale(), (0u32..n).into_segmented())
        .map_err(pe)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(value_desc)
        .x_label_formatter(&|v| y_label(*v))
        .y_labels(bars.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => bars
                .get(*i as usize)
                .map(|b| b.0.clone())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(pe)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            let i = i as u32;
            let mut r = Rectangle::new(
                [
                    (lo, SegmentValue::Exact(i)),
                    (b.1, SegmentValue::Exact(i + 1)),
                ],
                b.2.filled(),
            );
            r.set_margin(8, 8, 0, 0);
            r
        }))
        .map_err(pe)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            Text::new(
                format!("  {}", crate::stats::human(b.1)),
                (b.1, SegmentValue::CenterOf(i as u32)),
                TextStyle::from(("sans-serif", 16).into_font())
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            )
        }))
        .map_err(pe)?;
    root.present().map_err(pe)?;
    Ok(())
}
