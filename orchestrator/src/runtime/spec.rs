//! `--gpus` and `--topology`: which workers a run has.

use std::fmt;

/// One worker's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Gpu(u32),
    /// A CPU worker (index among the CPU workers).
    Cpu(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Gpu(i) => write!(f, "gpu:{i}"),
            Device::Cpu(i) => write!(f, "cpu:{i}"),
        }
    }
}

/// `--gpus` as written: GPU ids (checked against the machine later; an id given twice puts two
/// workers on that GPU) or `cpu:N`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSpec {
    All,
    Ids(Vec<u32>),
    Cpu(u32),
}

impl std::str::FromStr for GpuSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let bad = |why: &str| {
            format!("invalid --gpus {s:?}: {why} (expected e.g. 0-7, 0,2,5, all or cpu:4)")
        };
        if s == "all" {
            return Ok(GpuSpec::All);
        }
        if let Some(n) = s.strip_prefix("cpu:") {
            let n: u32 = n
                .parse()
                .map_err(|_| bad("cpu:N needs a number of workers"))?;
            if n == 0 || n > 256 {
                return Err(bad("cpu:N needs 1 to 256 workers"));
            }
            return Ok(GpuSpec::Cpu(n));
        }
        let mut ids = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let parse = |x: &str| -> Result<u32, String> {
                x.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|&v| v < 1024)
                    .ok_or_else(|| bad(&format!("{x:?} is not a GPU id")))
            };
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (parse(a)?, parse(b)?);
                    if b < a {
                        return Err(bad(&format!("range {a}-{b} runs backwards")));
                    }
                    ids.extend(a..=b);
                }
                None => ids.push(parse(part)?),
            }
        }
        // A GPU listed twice runs two workers (they share its memory; the launch checks the fit).
        Ok(GpuSpec::Ids(ids))
    }
}

impl GpuSpec {
    /// The workers' devices, given how many GPUs the machine has (`Err` with the reason when it
    /// has none).
    pub fn devices(&self, gpus: Result<u32, String>) -> Result<Vec<Device>, String> {
        match self {
            GpuSpec::Cpu(n) => Ok((0..*n).map(Device::Cpu).collect()),
            GpuSpec::All | GpuSpec::Ids(_) => {
                let count = gpus.map_err(|why| {
                    format!("--gpus asks for GPUs, but none was found ({why}); use --gpus cpu:N for CPU workers")
                })?;
                let ids: Vec<u32> = match self {
                    GpuSpec::All => (0..count).collect(),
                    GpuSpec::Ids(ids) => ids.clone(),
                    GpuSpec::Cpu(_) => unreachable!(),
                };
                if let Some(bad) = ids.iter().find(|&&i| i >= count) {
                    return Err(format!(
                        "--gpus names GPU {bad}, but this machine has {count} (0-{})",
                        count.saturating_sub(1)
                    ));
                }
                if ids.is_empty() {
                    return Err("--gpus all: this machine has no GPU; use --gpus cpu:N".into());
                }
                Ok(ids.into_iter().map(Device::Gpu).collect())
            }
        }
    }
}

/// `--topology T:D`: T target workers and D drafter workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub targets: u32,
    pub drafters: u32,
}

impl std::str::FromStr for Topology {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid --topology {s:?}: expected T:D (e.g. 6:1) or auto");
        let (t, d) = s.split_once(':').ok_or_else(bad)?;
        let targets: u32 = t.trim().parse().map_err(|_| bad())?;
        let drafters: u32 = d.trim().parse().map_err(|_| bad())?;
        if targets == 0 || drafters == 0 {
            return Err(format!(
                "invalid --topology {s:?}: a run needs at least one target and one drafter"
            ));
        }
        Ok(Topology { targets, drafters })
    }
}

impl Topology {
    /// The topology for `workers` workers: as given (checked) or all but one as targets.
    pub fn resolve(given: Option<Topology>, workers: u32) -> Result<Topology, String> {
        match given {
            Some(t) if u64::from(t.targets) + u64::from(t.drafters) != u64::from(workers) => {
                Err(format!(
                    "--topology {}:{} needs {} workers, --gpus gives {workers}",
                    t.targets,
                    t.drafters,
                    u64::from(t.targets) + u64::from(t.drafters)
                ))
            }
            Some(t) => Ok(t),
            None if workers < 2 => Err(format!(
                "a run needs at least 2 workers (1 target, 1 drafter); --gpus gives {workers}"
            )),
            None => Ok(Topology {
                targets: workers - 1,
                drafters: 1,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_topologies_are_refused_without_overflow() {
        let t: Topology = "4294967295:1".parse().unwrap();
        let e = Topology::resolve(Some(t), 8).unwrap_err();
        assert!(e.contains("needs 4294967296 workers"), "{e}");
    }

    #[test]
    fn parses_gpu_specs() {
        assert_eq!(
            "0-3".parse::<GpuSpec>().unwrap(),
            GpuSpec::Ids(vec![0, 1, 2, 3])
        );
        assert_eq!(
            "0,2,5".parse::<GpuSpec>().unwrap(),
            GpuSpec::Ids(vec![0, 2, 5])
        );
        assert_eq!(
            "0-1,4".parse::<GpuSpec>().unwrap(),
            GpuSpec::Ids(vec![0, 1, 4])
        );
        assert_eq!("all".parse::<GpuSpec>().unwrap(), GpuSpec::All);
        assert_eq!("cpu:3".parse::<GpuSpec>().unwrap(), GpuSpec::Cpu(3));
        // Two workers sharing GPU 0.
        assert_eq!("0,0".parse::<GpuSpec>().unwrap(), GpuSpec::Ids(vec![0, 0]));
        for bad in ["", "3-1", "cpu:0", "cpu:x", "gpu", "-1", "1,,2", "99999"] {
            assert!(bad.parse::<GpuSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn gpu_ids_need_gpus() {
        let e = GpuSpec::Ids(vec![0])
            .devices(Err("NVML not found".into()))
            .unwrap_err();
        assert!(e.contains("cpu:N"), "{e}");
        let e = GpuSpec::Ids(vec![0, 4]).devices(Ok(2)).unwrap_err();
        assert!(e.contains("GPU 4"), "{e}");
        assert_eq!(
            GpuSpec::All.devices(Ok(2)).unwrap(),
            vec![Device::Gpu(0), Device::Gpu(1)]
        );
        assert_eq!(
            GpuSpec::Cpu(2).devices(Err(String::new())).unwrap(),
            vec![Device::Cpu(0), Device::Cpu(1)]
        );
    }

    #[test]
    fn topology_matches_worker_count() {
        assert_eq!(
            Topology::resolve(None, 8).unwrap(),
            Topology {
                targets: 7,
                drafters: 1
            }
        );
        assert!(Topology::resolve(None, 1).is_err());
        let t: Topology = "6:1".parse().unwrap();
        assert!(Topology::resolve(Some(t), 7).is_ok());
        assert!(
            Topology::resolve(Some(t), 3)
                .unwrap_err()
                .contains("needs 7 workers")
        );
        assert!("6".parse::<Topology>().is_err());
        assert!("0:1".parse::<Topology>().is_err());
    }
}
