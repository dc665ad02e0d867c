//! The report's PNG charts, drawn with plotters into an RGB buffer and encoded by `image`.
//! Text uses DejaVu Sans, compiled in (the `dejavu` crate), so the charts look the same on a
//! machine without fonts (a pod, CI).

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use telemetry::Step;

use crate::ReportError;
use crate::run::{MarkerKind, RunData};

/// One chart as written, with the series it shows (what `report.json` lists).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Chart {
    pub file: String,
    pub title: String,
    pub series: Vec<Series>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Series {
    pub name: String,
    /// Points (lines), bars or cells.
    pub points: usize,
    /// `#rrggbb`, the colour it is drawn in (none for the heat map's shades).
    pub colour: Option<String>,
}

/// The palette (matplotlib's "tab10"), so the charts read like the ones users know.
pub(crate) const BLUE: RGBColor = RGBColor(31, 119, 180);
pub(crate) const ORANGE: RGBColor = RGBColor(255, 127, 14);
pub(crate) const GREEN: RGBColor = RGBColor(44, 160, 44);
pub(crate) const RED: RGBColor = RGBColor(214, 39, 40);
pub(crate) const PURPLE: RGBColor = RGBColor(148, 103, 189);

pub(crate) const GREY: RGBColor = RGBColor(127, 127, 127);
pub(crate) const TEAL: RGBColor = RGBColor(23, 190, 207);

/// Each kind of marker: its colour and its name in the legend.
const MARKERS: [(MarkerKind, RGBColor, &str); 5] = [
    (MarkerKind::Restart, RED, "restart"),
    (MarkerKind::Resumed, GREY, "resumed by hand"),
    (MarkerKind::WorldSize, PURPLE, "world size change"),
    (MarkerKind::Regroup, TEAL, "regrouped in place"),
    (MarkerKind::Straggler, ORANGE, "straggler found or gone"),
];

/// The colours of the ranks' lines, in turn.
const PALETTE: [RGBColor; 7] = [BLUE, ORANGE, GREEN, RED, PURPLE, GREY, TEAL];

/// Where a marker's label lies on the chart: pixels from the plot's left, and its row.
struct Span {
    left: f64,
    right: f64,
    row: i32,
}

/// The first row where a label from `left` to `right` (pixels) crosses none of `placed`.
fn free_row(placed: &[Span], left: f64, right: f64) -> i32 {
    let gap = 4.0;
    (0..)
        .find(|&row| {
            !placed
                .iter()
                .any(|p| p.row == row && left < p.right + gap && p.left < right + gap)
        })
        .unwrap_or(0)
}

/// A marker's label is drawn to the right of its line, or to the left when it would run past
/// the plot's right edge (about this many pixels a character at the labels' size).
const LABEL_CHAR_PX: i32 = 7;

const WIDE: (u32, u32) = (960, 440);
const SQUARE: (u32, u32) = (720, 640);
const FONT: &str = "sans-serif";

fn hex(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is compiled in and known to parse; a failure would only mean no text.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

fn draw_err(chart: &str) -> impl Fn(&dyn std::fmt::Display) -> ReportError + '_ {
    move |e| ReportError::Draw {
        chart: chart.to_string(),
        problem: e.to_string(),
    }
}

/// Draws into an RGB buffer with `draw` and writes it as `path` (PNG).
fn png(
    path: &Path,
    (w, h): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> Result<(), String>,
) -> Result<(), ReportError> {
    register_font();
    let name = path.display().to_string();
    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        draw(&root).map_err(|e| draw_err(&name)(&e))?;
        root.present().map_err(|e| draw_err(&name)(&e))?;
    }
    let img = image::RgbImage::from_raw(w, h, buf).ok_or_else(|| ReportError::Draw {
        chart: name.clone(),
        problem: "buffer size".into(),
    })?;
    img.save_with_format(path, image::ImageFormat::Png)
        .map_err(|e| draw_err(&name)(&e))
}

/// Every chart the run has data for, written into `dir`.
pub(crate) fn draw_all(data: &RunData, dir: &Path) -> Result<Vec<Chart>, ReportError> {
    let mut charts = Vec::new();
    if data.steps().next().is_some() {
        charts.push(step_chart(
            data,
            dir,
            "loss.png",
            "Training loss",
            "loss",
            &[("loss", BLUE, |s: &Step| s.loss as f64)],
        )?);
        charts.push(step_chart(
            data,
            dir,
            "throughput.png",
            "Throughput (all workers)",
            "images/s",
            &[("images/s", GREEN, |s: &Step| s.images_per_sec)],
        )?);
        charts.push(step_chart(
            data,
            dir,
            "step_time.png",
            "Step time, rank 0",
            "seconds",
            &[
                ("compute", BLUE, |s: &Step| s.compute_s),
                ("all-reduce", ORANGE, |s: &Step| s.allreduce_s),
                ("data", GREEN, |s: &Step| s.data_s),
            ],
        )?);
    }
    if data.rank_busy.len() > 1 {
        charts.push(rank_chart(data, dir)?);
    }
    if let Some(eval) = &data.eval {
        charts.push(class_accuracy(eval, dir)?);
        let file = "confusion.png";
        confusion_png(eval, &dir.join(file))?;
        charts.push(Chart {
            file: file.into(),
            title: "Confusion matrix".into(),
            series: vec![Series {
                name: "test images".into(),
                points: eval.confusion.iter().map(Vec::len).sum(),
                colour: None,
            }],
        });
    }
    Ok(charts)
}

type Value = fn(&Step) -> f64;

/// A chart over global steps, drawn into by the step charts.
type StepChart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The axes every chart over global steps has: steps across, `y_desc` up to `y_max`.
fn step_axes<'a, 'b>(
    root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    title: &str,
    steps: std::ops::Range<f64>,
    y_max: f64,
    y_desc: &str,
) -> Result<StepChart<'a, 'b>, String> {
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(steps, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc(y_desc)
        .label_style((FONT, 13))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// The legend of a step chart, at `position`.
fn legend<'a, 'b: 'a>(
    chart: &mut StepChart<'a, 'b>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .label_font((FONT, 13))
        .draw()
        .map_err(|e| e.to_string())
}

/// A chart over global steps: one line per value (each attempt drawn as its own segment, so
/// a restart's repeated steps do not zigzag), and a vertical line at each marker.
fn step_chart(
    data: &RunData,
    dir: &Path,
    file: &str,
    title: &str,
    y_desc: &str,
    values: &[(&str, RGBColor, Value)],
) -> Result<Chart, ReportError> {
    let steps: Vec<&Step> = data.steps().collect();
    let x_max = steps.iter().map(|s| s.step).max().unwrap_or(1).max(1) as f64;
    let x_min = steps
        .iter()
        .map(|s| s.step)
        .min()
        .unwrap_or(0)
        .saturating_sub(1) as f64;
    let y_max = values
        .iter()
        .flat_map(|(_, _, f)| steps.iter().map(move |s| f(s)))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let mut series: Vec<Series> = values
        .iter()
        .map(|(name, colour, _)| Series {
            name: name.to_string(),
            points: steps.len(),
            colour: Some(hex(*colour)),
        })
        .collect();
    for (kind, colour, name) in MARKERS {
        let n = data.count(kind);
        if n > 0 {
            series.push(Series {
                name: name.into(),
                points: n,
                colour: Some(hex(colour)),
            });
        }
    }
    png(&dir.join(file), WIDE, |root| {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = step_axes(root, title, x_min..x_max, y_max, y_desc)?;
        for (name, colour, f) in values {
            for (i, attempt) in data.attempts.iter().enumerate() {
                let line = LineSeries::new(
                    attempt
                        .steps
                        .iter()
                        .map(|s| (s.step as f64, f(s).min(y_max))),
                    colour.stroke_width(2),
                );
                let drawn = chart.draw_series(line).map_err(|e| e.to_string())?;
                if i == 0 {
                    drawn.label(*name).legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                    });
                }
            }
        }
        draw_markers(&mut chart, data, x_min..x_max, y_max)?;
        // Lower left: marker labels take the top, a falling loss the lower right.
        legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        Ok(())
    })?;
    Ok(Chart {
        file: file.into(),
        title: title.into(),
        series,
    })
}

/// A vertical line at each marker of `data`, a legend entry per kind, and each marker's label
/// at the top of its line (see [`place_label`]).
fn draw_markers<'a, 'b: 'a>(
    chart: &mut StepChart<'a, 'b>,
    data: &RunData,
    steps: std::ops::Range<f64>,
    y_max: f64,
) -> Result<(), String> {
    let plot_px = chart.plotting_area().dim_in_pixel().0 as f64;
    let mut labelled: Vec<Span> = Vec::new();
    for (kind, colour, legend) in MARKERS {
        let marks: Vec<_> = data.markers.iter().filter(|m| m.kind == kind).collect();
        if marks.is_empty() {
            continue;
        }
        let drawn = chart
            .draw_series(marks.iter().map(|m| {
                PathElement::new(
                    [(m.step as f64, 0.0), (m.step as f64, y_max)],
                    colour.stroke_width(2),
                )
            }))
            .map_err(|e| e.to_string())?;
        drawn
            .label(legend)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
        let placed: Vec<_> = marks
            .iter()
            .map(|m| {
                let x_px = (m.step as f64 - steps.start) / (steps.end - steps.start) * plot_px;
                let width = m.label.chars().count() as i32 * LABEL_CHAR_PX;
                (m, place_label(&mut labelled, x_px, width, plot_px))
            })
            .collect();
        chart
            .draw_series(placed.into_iter().map(|(m, offset)| {
                EmptyElement::at((m.step as f64, y_max))
                    + Text::new(
                        m.label.clone(),
                        offset,
                        (FONT, 13).into_font().color(&colour),
                    )
            }))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Where a label `width` pixels wide goes against its line at `x_px`, as an offset: to the
/// right of the line, or to its left when it would cross the plot's right edge; one row under
/// any label already `placed` that it would overlap. It joins `placed`.
fn place_label(placed: &mut Vec<Span>, x_px: f64, width: i32, plot_px: f64) -> (i32, i32) {
    let dx = if x_px + 5.0 + width as f64 > plot_px {
        -5 - width
    } else {
        5
    };
    let left = x_px + dx as f64;
    let right = left + width as f64;
    let row = free_row(placed, left, right);
    placed.push(Span { left, right, row });
    (dx, 4 + 16 * row)
}

/// Each rank's time before the all-reduce (waiting for data and computing) at each step: a
/// straggler's line stands above the others, where the straggler markers are.
fn rank_chart(data: &RunData, dir: &Path) -> Result<Chart, ReportError> {
    let file = "rank_step_time.png";
    let points = || data.rank_busy.iter().flat_map(|(_, s)| s.iter());
    let x_max = points().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let x_min = points().map(|p| p.0).min().unwrap_or(0).saturating_sub(1) as f64;
    let y_max = points()
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let colour = |i: usize| PALETTE[i % PALETTE.len()];
    let mut series: Vec<Series> = data
        .rank_busy
        .iter()
        .enumerate()
        .map(|(i, (rank, steps))| Series {
            name: format!("rank {rank}"),
            points: steps.len(),
            colour: Some(hex(colour(i))),
        })
        .collect();
    let stragglers: Vec<_> = data
        .markers
        .iter()
        .filter(|m| m.kind == MarkerKind::Straggler)
        .collect();
    if !stragglers.is_empty() {
        series.push(Series {
            name: "straggler found or gone".into(),
            points: stragglers.len(),
            colour: Some(hex(ORANGE)),
        });
    }
    png(&dir.join(file), WIDE, |root| {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = step_axes(
            root,
            "Time before the all-reduce, per rank",
            x_min..x_max,
            y_max,
            "seconds (data + compute)",
        )?;
        // Many ranks: thin lines, and only the first few in the legend.
        let width = if data.rank_busy.len() > 16 { 1 } else { 2 };
        for (i, (rank, steps)) in data.rank_busy.iter().enumerate() {
            let c = colour(i);
            let drawn = chart
                .draw_series(LineSeries::new(
                    steps
                        .iter()
                        .map(|(step, busy)| (*step as f64, busy.min(y_max))),
                    c.stroke_width(width),
                ))
                .map_err(|e| e.to_string())?;
            if i < PALETTE.len() {
                drawn.label(format!("rank {rank}")).legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2))
                });
            }
        }
        chart
            .draw_series(stragglers.iter().map(|m| {
                PathElement::new(
                    [(m.step as f64, 0.0), (m.step as f64, y_max)],
                    ORANGE.stroke_width(2),
                )
            }))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(stragglers.iter().map(|m| {
                EmptyElement::at((m.step as f64, y_max))
                    + Text::new(
                        m.label.clone(),
                        (5, 4),
                        (FONT, 13).into_font().color(&ORANGE),
                    )
            }))
            .map_err(|e| e.to_string())?;
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        Ok(())
    })?;
    Ok(Chart {
        file: file.into(),
        title: "Time before the all-reduce, per rank".into(),
        series,
    })
}

fn class_accuracy(eval: &telemetry::metrics::Eval, dir: &Path) -> Result<Chart, ReportError> {
    let file = "class_accuracy.png";
    let n = eval.classes.len();
    png(&dir.join(file), WIDE, |root| {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!(
            "Test accuracy per class (overall {:.1} % of {} images)",
            eval.accuracy, eval.images
        );
        let mut chart = ChartBuilder::on(root)
            .caption(title, (FONT, 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d((0..n.max(1) - 1).into_segmented(), 0.0..100.0)
            .map_err(|e| e.to_string())?;
        let classes = eval.classes.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc("accuracy (%)")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_labels(n)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => classes.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style((FONT, 13))
            .draw()
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(
                Histogram::vertical(&chart)
                    .style(BLUE.filled())
                    .margin(8)
                    .data(
                        eval.class_accuracy
                            .iter()
                            .enumerate()
                            .map(|(i, a)| (i, a.unwrap_or(0.0))),
                    ),
            )
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(eval.class_accuracy.iter().enumerate().map(|(i, a)| {
                let text = a.map_or("n/a".into(), |a| format!("{a:.1}"));
                // Above the bar, or inside its top in white when there is no room above.
                let (y, colour) = match a.unwrap_or(0.0) {
                    a if a > 92.0 => (a - 7.0, &WHITE),
                    a => (a + 1.5, &BLACK),
                };
                Text::new(
                    text,
                    (SegmentValue::CenterOf(i), y),
                    TextStyle::from((FONT, 13).into_font()).color(colour).pos(
                        plotters::style::text_anchor::Pos::new(
                            plotters::style::text_anchor::HPos::Center,
                            plotters::style::text_anchor::VPos::Bottom,
                        ),
                    ),
                )
            }))
            .map_err(|e| e.to_string())?;
        Ok(())
    })?;
    Ok(Chart {
        file: file.into(),
        title: "Test accuracy per class".into(),
        series: vec![Series {
            name: "accuracy".into(),
            points: n,
            colour: Some(hex(BLUE)),
        }],
    })
}

/// The confusion matrix as a heat map: rows are true classes, columns predictions, each cell
/// shaded by its share of the row and labelled with its count.
pub fn confusion_png(eval: &telemetry::metrics::Eval, path: &Path) -> Result<(), ReportError> {
    let n = eval.classes.len().max(1);
    // With many classes (tiny-imagenet's 200) a cell is a few pixels: no counts in the cells,
    // and about ten class names per axis, at the cells' corners.
    let many = n > 20;
    let (labels, x_offset, y_offset) = if many {
        (n.div_ceil(n.div_ceil(10)), 0, 0)
    } else {
        (n, 30, -26)
    };
    png(path, SQUARE, |root| {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(root)
            .caption("Confusion matrix (row: true class)", (FONT, 22))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(0..n, 0..n)
            .map_err(|e| e.to_string())?;
        let classes = eval.classes.clone();
        let label = |v: &usize| classes.get(*v).cloned().unwrap_or_default();
        // Row 0 at the top, as printed matrices read.
        let y = |t: usize| n - 1 - t;
        let row_label = |v: &usize| if *v < n { label(&y(*v)) } else { String::new() };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("predicted")
            .y_desc("true")
            .x_labels(labels)
            .y_labels(labels)
            .x_label_offset(x_offset)
            .y_label_offset(y_offset)
            .x_label_formatter(&label)
            .y_label_formatter(&row_label)
            .label_style((FONT, 13))
            .draw()
            .map_err(|e| e.to_string())?;
        let cells = eval.confusion.iter().enumerate().flat_map(|(t, row)| {
            let total = row.iter().sum::<u64>().max(1) as f64;
            row.iter()
                .enumerate()
                .map(move |(p, &c)| (t, p, c, c as f64 / total))
        });
        let cells: Vec<_> = cells.collect();
        chart
            .draw_series(cells.iter().map(|&(t, p, _, share)| {
                Rectangle::new([(p, y(t)), (p + 1, y(t) + 1)], heat(share).filled())
            }))
            .map_err(|e| e.to_string())?;
        if many {
            return Ok(());
        }
        chart
            .draw_series(cells.iter().map(|&(t, p, count, share)| {
                let colour = if share > 0.5 { WHITE } else { BLACK };
                EmptyElement::at((p, y(t) + 1))
                    + Text::new(
                        count.to_string(),
                        (8, 8),
                        (FONT, 14).into_font().color(&colour),
                    )
            }))
            .map_err(|e| e.to_string())?;
        Ok(())
    })
}

/// White to dark blue.
fn heat(share: f64) -> RGBColor {
    let s = share.clamp(0.0, 1.0);
    let mix = |from: u8, to: u8| (from as f64 + (to as f64 - from as f64) * s).round() as u8;
    RGBColor(mix(247, 8), mix(251, 48), mix(255, 107))
}

#[cfg(test)]
mod tests {
    use super::{Span, free_row, place_label};

    #[test]
    fn a_label_past_the_right_edge_goes_left_of_its_line() {
        let mut placed = Vec::new();
        assert_eq!(place_label(&mut placed, 100.0, 50, 400.0), (5, 4));
        assert_eq!(place_label(&mut placed, 380.0, 50, 400.0), (-55, 4));
        assert_eq!(place_label(&mut placed, 120.0, 50, 400.0), (5, 20));
    }

    #[test]
    fn labels_that_would_overlap_go_one_row_under_the_other() {
        let mut placed = Vec::new();
        for (left, right, row) in [
            (10.0, 100.0, 0),
            (60.0, 150.0, 1),
            (120.0, 200.0, 0),
            (70.0, 90.0, 2),
            (300.0, 350.0, 0),
        ] {
            assert_eq!(free_row(&placed, left, right), row, "{left}..{right}");
            placed.push(Span { left, right, row });
        }
    }
}
