//! The settings that take one of a few names, each one enum that every crate reading, writing
//! or acting on it shares: the CLI parses its flag into it, a project's row reads its value
//! into it, deploy renders it back into the pods' command line, and the crate that acts on it
//! matches on it. A name is written once, here.

/// A setting with a few named values.
pub trait Choice: Copy + Eq + 'static {
    /// Every value, the default first.
    const ALL: &'static [Self];

    /// Its name on the command line and in settings.
    fn name(self) -> &'static str;

    /// The value called `text` (or one of its other spellings).
    fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|c| c.name() == text || c.aliases().contains(&text))
    }

    /// Other spellings it takes.
    fn aliases(self) -> &'static [&'static str] {
        &[]
    }

    /// `a, b or c`: the names, for messages.
    fn choices() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|c| c.name()).collect();
        match names.split_last() {
            Some((last, [])) => (*last).to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }
}

/// Implements [`Choice`] and `Display` for an enum from `Variant => "name"` lines; the first
/// is the default. `name` is also a `const fn`, for the settings table's defaults.
macro_rules! choice {
    ($t:ident { $($v:ident => $name:literal $(| $alias:literal)*),+ $(,)? }) => {
        impl $t {
            /// Its name on the command line and in settings.
            pub const fn name(self) -> &'static str {
                match self {
                    $($t::$v => $name),+
                }
            }
        }

        impl Choice for $t {
            const ALL: &'static [Self] = &[$($t::$v),+];

            fn name(self) -> &'static str {
                $t::name(self)
            }

            fn aliases(self) -> &'static [&'static str] {
                match self {
                    $($t::$v => &[$($alias),*]),+
                }
            }
        }

        impl Default for $t {
            fn default() -> Self {
                Self::ALL[0]
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

/// What a straggling node's workers are told (`trainctl run --stragglers`, `job.stragglers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stragglers {
    /// Say so.
    Warn,
    /// Also drop it by a regroup in place, never below the job's minimum.
    Evict,
}
choice!(Stragglers { Warn => "warn", Evict => "evict" });

/// What a node far below the others in its health check does (`trainctl run --health-check`,
/// `job.health_check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthCheck {
    /// It joins, with a warning saying the figures.
    Warn,
    /// It does not join: the launch ends, saying the figures.
    Refuse,
    /// No check.
    Off,
}
choice!(HealthCheck { Warn => "warn", Refuse => "refuse", Off => "off" });

/// What the built-in trainer's convolutions round their inputs to (`trainctl train
/// --precision`, `job.precision`); the sums are f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 inputs.
    F32,
    /// bf16 inputs, f32 sums, as PyTorch's CPU autocast.
    Bf16,
}
choice!(Precision { F32 => "fp32" | "f32", Bf16 => "bf16" });

/// The networks of the built-in trainer (`trainctl train --model`, `job.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Model {
    /// The seed's CNN for CIFAR-10.
    SeedCnn,
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
}
choice!(Model {
    SeedCnn => "seed-cnn",
    ResNet18 => "resnet18",
    ResNet34 => "resnet34",
    ResNet50 => "resnet50",
    ResNet101 => "resnet101",
});

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<C: Choice + std::fmt::Debug>() {
        for c in C::ALL {
            assert_eq!(C::parse(c.name()), Some(*c));
            for alias in c.aliases() {
                assert_eq!(C::parse(alias), Some(*c));
            }
        }
        assert_eq!(C::parse("no such value"), None);
    }

    #[test]
    fn every_name_reads_back_as_its_value() {
        round_trips::<Stragglers>();
        round_trips::<HealthCheck>();
        round_trips::<Precision>();
        round_trips::<Model>();
    }

    #[test]
    fn the_choices_read_as_a_sentence() {
        assert_eq!(HealthCheck::choices(), "warn, refuse or off");
        assert_eq!(Precision::choices(), "fp32 or bf16");
        assert_eq!(Stragglers::default(), Stragglers::Warn);
        assert_eq!(Model::default().to_string(), "seed-cnn");
    }
}
