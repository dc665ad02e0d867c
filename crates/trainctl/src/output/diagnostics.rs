//! tracing's own lines (a store not reachable yet, a heartbeat failing) at the default level,
//! written the way the rest of trainctl's output is: one plain line, `trainctl: warning: ...`,
//! no timestamp or module path, so that a pod's log reads as one voice. With `RUST_LOG` set,
//! tracing's full format (time, level, target, spans) is kept for whoever asked for it.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The default level's format: `trainctl: warning: MESSAGE (VALUE; VALUE)`: the event's
/// fields said as words after its message, never tracing's `key=value`.
pub(crate) struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            _ => "note",
        };
        let mut words = Words::default();
        event.record(&mut words);
        writeln!(writer, "trainctl: {level}: {}", words.line())
    }
}

/// An event's message and its other fields' values, in order.
#[derive(Default)]
struct Words {
    message: String,
    values: Vec<String>,
}

impl Words {
    fn line(&self) -> String {
        if self.values.is_empty() {
            self.message.clone()
        } else {
            format!("{} ({})", self.message, self.values.join("; "))
        }
    }
}

impl tracing::field::Visit for Words {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            self.values.push(value.to_string());
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.values.push(format!("{value:?}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Words;

    #[test]
    fn fields_read_as_words_after_the_message() {
        let words = Words {
            message: "heartbeat failed; retrying".into(),
            values: vec!["rendezvous store at a:1 did not answer".into()],
        };
        assert_eq!(
            words.line(),
            "heartbeat failed; retrying (rendezvous store at a:1 did not answer)"
        );
        let alone = Words {
            message: "rendezvous heartbeats reach the store again".into(),
            values: vec![],
        };
        assert_eq!(alone.line(), "rendezvous heartbeats reach the store again");
    }
}
