//! tracing's own lines (a store not reachable yet, a heartbeat failing) at the default level,
//! written the way the rest of trainctl's output is: one plain line, `trainctl: warning: ...`,
//! no timestamp or module path, so that a pod's log reads as one voice. With `RUST_LOG` set,
//! tracing's full format (time, level, target, spans) is kept for whoever asked for it.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The default level's format: `trainctl: warning: MESSAGE key=value ...`.
pub struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            _ => "note",
        };
        write!(writer, "trainctl: {level}: ")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
