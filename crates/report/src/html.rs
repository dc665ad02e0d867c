//! The report page: one HTML file with the charts inlined (base64 PNGs), the run's
//! configuration, timings and final numbers; no scripts, no external resources.

use std::fmt::Write as _;
use std::path::Path;

use base64::Engine as _;

use crate::ReportError;
use crate::charts::Chart;
use crate::run::{MarkerKind, RunData};

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn row(out: &mut String, key: &str, value: &str) {
    let _ = writeln!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(key), esc(value));
}

/// The report page for `data`, section by section, with `charts` (PNG files in `dir`) inlined.
pub(crate) fn page(data: &RunData, charts: &[Chart], dir: &Path) -> Result<String, ReportError> {
    let mut out = String::new();
    head(&mut out, data);
    results(&mut out, data);
    class_accuracy(&mut out, data);
    inline_charts(&mut out, charts, dir)?;
    timings(&mut out, data);
    configuration(&mut out, data);
    out.push_str("</body></html>\n");
    Ok(out)
}

/// The document's head (title, the inline style sheet) and the page's heading: the run's id
/// and folder.
fn head(out: &mut String, data: &RunData) {
    let title = data
        .config
        .as_ref()
        .map_or("trainctl run".to_string(), |c| {
            format!("trainctl run {}", c.run_id)
        });
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>\
         body{{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}}\
         table{{border-collapse:collapse;margin:0.5em 0 1.5em}}th,td{{padding:3px 12px;border-bottom:1px solid #ddd;text-align:left}}\
         td.n{{text-align:right;font-variant-numeric:tabular-nums}}img{{max-width:100%;margin:0.5em 0 1.5em}}\
         </style></head><body>\n<h1>{}</h1>\n<p>{}</p>\n",
        esc(&title),
        esc(&title),
        esc(&data.run_dir)
    );
}

/// The results table: steps, final loss, test accuracy, world sizes, restarts, regroups,
/// checkpoints, wall time, throughput, and the metrics lines that could not be read.
fn results(out: &mut String, data: &RunData) {
    out.push_str("<h2>Results</h2>\n<table>\n");
    if let Some(last) = data.last_step() {
        row(out, "steps", &last.step.to_string());
        row(out, "epochs done", &data.epochs_done.to_string());
        row(out, "final training loss", &format!("{:.4}", last.loss));
    }
    if let Some(eval) = &data.eval {
        row(
            out,
            "test accuracy",
            &format!("{:.2} % of {} images", eval.accuracy, eval.images),
        );
    }
    let sizes: Vec<String> = data.world_sizes().iter().map(u32::to_string).collect();
    row(out, "world size", &sizes.join(" → "));
    row(out, "restarts", &data.restarts().to_string());
    row(
        out,
        "regroups in place",
        &data.count(MarkerKind::Regroup).to_string(),
    );
    let resumed = data.count(MarkerKind::Resumed);
    if resumed > 0 {
        row(out, "resumed by hand", &resumed.to_string());
    }
    row(out, "checkpoints written", &data.checkpoints.to_string());
    row(
        out,
        "wall time",
        &if data.idle_s > 0.0 {
            format!(
                "{:.1} s (first record to last, less {:.1} s stopped before being started again)",
                data.wall_s, data.idle_s
            )
        } else {
            format!("{:.1} s (first record to last)", data.wall_s)
        },
    );
    let steps: Vec<_> = data.steps().collect();
    if !steps.is_empty() {
        let images: usize = steps.iter().map(|s| s.images).sum();
        let seconds: f64 = steps.iter().map(|s| s.step_s).sum();
        row(
            out,
            "throughput",
            &format!(
                "{:.1} images/s over {} steps (time in steps only)",
                images as f64 / seconds.max(f64::MIN_POSITIVE),
                steps.len()
            ),
        );
    }
    if data.skipped > 0 {
        row(
            out,
            "unreadable metrics lines",
            &format!("{} (partial lines left by a crash)", data.skipped),
        );
    }
    out.push_str("</table>\n");
}

/// The test accuracy of each class, when the run was evaluated.
fn class_accuracy(out: &mut String, data: &RunData) {
    if let Some(eval) = &data.eval {
        out.push_str("<h2>Test accuracy per class</h2>\n<table>\n");
        for (name, acc) in eval.classes.iter().zip(&eval.class_accuracy) {
            let acc = acc.map_or("n/a".into(), |a| format!("{a:.1} %"));
            let _ = writeln!(
                out,
                "<tr><th>{}</th><td class=\"n\">{}</td></tr>",
                esc(name),
                esc(&acc)
            );
        }
        out.push_str("</table>\n");
    }
}

/// Each chart's PNG (read from `dir`) inlined as a data URL under its title.
fn inline_charts(out: &mut String, charts: &[Chart], dir: &Path) -> Result<(), ReportError> {
    out.push_str("<h2>Charts</h2>\n");
    for chart in charts {
        let path = dir.join(&chart.file);
        let bytes = std::fs::read(&path).map_err(|source| ReportError::Write {
            path: path.clone(),
            source,
        })?;
        let _ = writeln!(
            out,
            "<h3>{}</h3>\n<img alt=\"{}\" src=\"data:image/png;base64,{}\">",
            esc(&chart.title),
            esc(&chart.title),
            base64::engine::general_purpose::STANDARD.encode(bytes)
        );
    }
    Ok(())
}

/// Each rank's mean seconds per step, split into data, compute and all-reduce.
fn timings(out: &mut String, data: &RunData) {
    if !data.timings.is_empty() {
        out.push_str(
            "<h2>Timings (mean seconds per step)</h2>\n<table>\n<tr><th>rank</th><th>steps</th><th>step</th><th>data</th><th>compute</th><th>all-reduce</th></tr>\n",
        );
        for t in &data.timings {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{:.4}</td><td class=\"n\">{:.4}</td><td class=\"n\">{:.4}</td><td class=\"n\">{:.4}</td></tr>",
                t.rank, t.steps, t.step_s, t.data_s, t.compute_s, t.allreduce_s
            );
        }
        out.push_str("</table>\n");
    }
}

/// The run's configuration, when it was recorded.
fn configuration(out: &mut String, data: &RunData) {
    if let Some(c) = &data.config {
        out.push_str("<h2>Configuration</h2>\n<table>\n");
        for (k, v) in c.rows() {
            row(out, k, &v);
        }
        out.push_str("</table>\n");
    }
}
