//! What trainctl knows about EC2 instance types and the cluster presets built on them.
//!
//! The figures are AWS's published specifications (vCPUs, memory, GPUs, EFA interfaces); they
//! size the pods' requests and decide whether a node group gets EFA.

/// The node label the training pods select by default: their nodes are of the instance type.
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";

/// One EC2 instance type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceType {
    pub name: &'static str,
    pub vcpus: u32,
    pub memory_gib: u32,
    /// NVIDIA GPUs (0 for CPU instances).
    pub gpus: u32,
    /// EFA network interfaces (0: no EFA).
    pub efa_interfaces: u32,
}

impl InstanceType {
    pub(crate) fn supports_efa(&self) -> bool {
        self.efa_interfaces > 0
    }

    /// EFA reads and writes GPU memory directly (GPUDirect RDMA), so NCCL's libfabric plugin is
    /// told `FI_EFA_USE_DEVICE_RDMA=1`: the p4d, p4de and p5 families (AWS's EFA documentation,
    /// "Supported instance types": RDMA read on p4d/p4de, read and write on p5).
    pub(crate) fn gpudirect_rdma(&self) -> bool {
        self.supports_efa() && (self.name.starts_with("p4d") || self.name.starts_with("p5"))
    }
}

const fn it(
    name: &'static str,
    vcpus: u32,
    memory_gib: u32,
    gpus: u32,
    efa_interfaces: u32,
) -> InstanceType {
    InstanceType {
        name,
        vcpus,
        memory_gib,
        gpus,
        efa_interfaces,
    }
}

/// The instance types trainctl sizes pods for. Ask for another by adding a line here.
pub(crate) const INSTANCE_TYPES: &[InstanceType] = &[
    it("c5.xlarge", 4, 8, 0, 0),
    it("c5.2xlarge", 8, 16, 0, 0),
    it("c5.4xlarge", 16, 32, 0, 0),
    it("c5.9xlarge", 36, 72, 0, 0),
    it("c5.12xlarge", 48, 96, 0, 0),
    it("c5.18xlarge", 72, 144, 0, 0),
    it("c5.24xlarge", 96, 192, 0, 0),
    it("c5n.9xlarge", 36, 96, 0, 1),
    it("c5n.18xlarge", 72, 192, 0, 1),
    it("c6i.4xlarge", 16, 32, 0, 0),
    it("c6i.32xlarge", 128, 256, 0, 1),
    it("c7i.4xlarge", 16, 32, 0, 0),
    it("m5.large", 2, 8, 0, 0),
    it("m5.xlarge", 4, 16, 0, 0),
    it("m5.2xlarge", 8, 32, 0, 0),
    it("m5.4xlarge", 16, 64, 0, 0),
    it("g4dn.xlarge", 4, 16, 1, 0),
    it("g4dn.2xlarge", 8, 32, 1, 0),
    it("g4dn.4xlarge", 16, 64, 1, 0),
    it("g4dn.8xlarge", 32, 128, 1, 1),
    it("g4dn.12xlarge", 48, 192, 4, 1),
    it("g4dn.16xlarge", 64, 256, 1, 1),
    it("g4dn.metal", 96, 384, 8, 1),
    it("g5.xlarge", 4, 16, 1, 0),
    it("g5.12xlarge", 48, 192, 4, 1),
    it("g5.48xlarge", 192, 768, 8, 1),
    it("p3.2xlarge", 8, 61, 1, 0),
    it("p3.8xlarge", 32, 244, 4, 0),
    it("p3.16xlarge", 64, 488, 8, 0),
    it("p3dn.24xlarge", 96, 768, 8, 1),
    it("p4d.24xlarge", 96, 1152, 8, 4),
    it("p4de.24xlarge", 96, 1152, 8, 4),
    it("p5.48xlarge", 192, 2048, 8, 32),
    it("p5e.48xlarge", 192, 2048, 8, 32),
    it("p5en.48xlarge", 192, 2048, 8, 16),
];

pub(crate) fn instance_type(name: &str) -> Option<&'static InstanceType> {
    INSTANCE_TYPES.iter().find(|t| t.name == name)
}

/// The seed tutorials' cluster architectures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preset {
    /// c5.4xlarge × 2: the CPU workshop.
    #[default]
    Cpu,
    /// g4dn.metal × 2, EFA (new or existing VPC).
    G4dn,
    /// p4de.24xlarge × 2 from an on-demand capacity reservation, EFA.
    P4deOdcr,
    /// p5.48xlarge × 2, EFA, a capacity reservation if given.
    P5,
}

impl Preset {
    pub const ALL: [Preset; 4] = [Preset::Cpu, Preset::G4dn, Preset::P4deOdcr, Preset::P5];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Cpu => "cpu",
            Preset::G4dn => "g4dn",
            Preset::P4deOdcr => "p4de-odcr",
            Preset::P5 => "p5",
        }
    }

    pub fn parse(s: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The worker instance type the preset reproduces.
    pub fn instance_type(self) -> &'static str {
        match self {
            Preset::Cpu => "c5.4xlarge",
            Preset::G4dn => "g4dn.metal",
            Preset::P4deOdcr => "p4de.24xlarge",
            Preset::P5 => "p5.48xlarge",
        }
    }

    /// Whether the workers must come from an on-demand capacity reservation.
    pub(crate) fn needs_capacity_reservation(self) -> bool {
        matches!(self, Preset::P4deOdcr)
    }
}

/// The two availability zones trainctl picks in `region` when none are given: the region's
/// first two by AWS's naming (the region and a letter). Zone letters map to physical zones per
/// account, and a few regions do not offer `a` and `b` to every account (us-west-1 offers two of
/// a, b and c; ap-northeast-1's `b` is closed to new accounts), so those get letters that exist
/// more widely; `--az` always overrides, and the CLI says which zones it picked.
pub(crate) fn default_zones(region: &str) -> [String; 2] {
    let letters = match region {
        "us-west-1" => ["b", "c"],
        "ap-northeast-1" => ["a", "c"],
        _ => ["a", "b"],
    };
    letters.map(|l| format!("{region}{l}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_names_a_known_instance_type_and_parses_back() {
        for p in Preset::ALL {
            assert!(instance_type(p.instance_type()).is_some(), "{p:?}");
            assert_eq!(Preset::parse(p.name()), Some(p));
        }
        assert_eq!(Preset::parse("gpu"), None);
    }

    #[test]
    fn instance_names_are_unique() {
        let mut names: Vec<_> = INSTANCE_TYPES.iter().map(|t| t.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), INSTANCE_TYPES.len());
    }
}
