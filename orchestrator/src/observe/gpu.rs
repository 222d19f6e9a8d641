//! The GPU monitor: readings of every GPU of the run through NVML, behind [`GpuSource`] so that the
//! parsing and warning logic runs in tests against a recorded fake device, and the warnings the
//! readings call for (XID errors, sustained thermal or power throttling).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One reading of one GPU. A value NVML refused is `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub gpu: u32,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    /// Energy since the driver loaded.
    pub energy_j: Option<f64>,
    pub utilization_pct: Option<u32>,
    pub memory_utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub temperature_c: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    /// Active clock-event (throttle) reasons, by name.
    pub throttle: Vec<String>,
}

/// An XID error reported by the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidEvent {
    pub gpu: u32,
    /// The XID number (`None`: the driver did not say).
    pub xid: Option<u64>,
}

/// Where readings come from: NVML, or a recording in tests.
pub trait GpuSource: Send {
    /// Reads GPU `gpu` (its NVML index).
    fn sample(&mut self, gpu: u32) -> Result<GpuSample, String>;
    /// XID errors since the last call (never blocks).
    fn xid_events(&mut self) -> Vec<XidEvent>;
}

/// Throttle reasons that mean the GPU is held back by heat or power (not idle or settings).
const HOT_OR_CAPPED: [&str; 5] = [
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
];

/// NVML through nvml-wrapper.
pub struct NvmlSource {
    nvml: &'static nvml_wrapper::Nvml,
    /// One XID event set per GPU: a GPU whose registration fails (NVML releases the set it was
    /// given) leaves the others' monitoring in place.
    events: Vec<nvml_wrapper::EventSet<'static>>,
}

impl NvmlSource {
    /// Reads `gpus` through `nvml`, registering each for XID events where the driver allows.
    pub fn new(nvml: &'static nvml_wrapper::Nvml, gpus: &[u32]) -> Self {
        let mut events = Vec::new();
        for &gpu in gpus {
            let registered = nvml
                .create_event_set()
                .map_err(|e| e.to_string())
                .and_then(|set| {
                    let device = nvml.device_by_index(gpu).map_err(|e| e.to_string())?;
                    device
                        .register_events(
                            nvml_wrapper::bitmasks::event::EventTypes::CRITICAL_XID_ERROR,
                            set,
                        )
                        .map_err(|e| e.error.to_string())
                });
            match registered {
                Ok(set) => events.push(set),
                Err(e) => tracing::warn!(gpu, "XID events are not available for this GPU: {e}"),
            }
        }
        Self { nvml, events }
    }
}

fn throttle_names(reasons: nvml_wrapper::bitmasks::device::ThrottleReasons) -> Vec<String> {
    use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
    [
        (T::GPU_IDLE, "gpu_idle"),
        (
            T::APPLICATIONS_CLOCKS_SETTING,
            "applications_clocks_setting",
        ),
        (T::SW_POWER_CAP, "sw_power_cap"),
        (T::HW_SLOWDOWN, "hw_slowdown"),
        (T::SYNC_BOOST, "sync_boost"),
        (T::SW_THERMAL_SLOWDOWN, "sw_thermal"),
        (T::HW_THERMAL_SLOWDOWN, "hw_thermal"),
        (T::HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake"),
        (T::DISPLAY_CLOCK_SETTING, "display_clock_setting"),
    ]
    .into_iter()
    .filter(|(bit, _)| reasons.contains(*bit))
    .map(|(_, name)| name.to_owned())
    .collect()
}

impl GpuSource for NvmlSource {
    fn sample(&mut self, gpu: u32) -> Result<GpuSample, String> {
        use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
        let d = self
            .nvml
            .device_by_index(gpu)
            .map_err(|e| format!("NVML: {e}"))?;
        let utilization = d.utilization_rates().ok();
        let memory = d.memory_info().ok();
        Ok(GpuSample {
            gpu,
            power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
            power_limit_w: d
                .enforced_power_limit()
                .ok()
                .map(|mw| f64::from(mw) / 1000.0),
            energy_j: d
                .total_energy_consumption()
                .ok()
                .map(|mj| mj as f64 / 1000.0),
            utilization_pct: utilization.as_ref().map(|u| u.gpu),
            memory_utilization_pct: utilization.as_ref().map(|u| u.memory),
            memory_used_bytes: memory.as_ref().map(|m| m.used),
            memory_total_bytes: memory.as_ref().map(|m| m.total),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            throttle: d
                .current_throttle_reasons()
                .map(throttle_names)
                .unwrap_or_default(),
        })
    }

    fn xid_events(&mut self) -> Vec<XidEvent> {
        let mut out = Vec::new();
        for set in &self.events {
            // A zero timeout returns at once when nothing is pending.
            while let Ok(event) = set.wait(0) {
                out.push(XidEvent {
                    gpu: event.device.index().unwrap_or(u32::MAX),
                    xid: match event.event_data {
                        Some(nvml_wrapper::enums::event::XidError::Value(v)) => Some(v),
                        _ => None,
                    },
                });
                if out.len() >= 64 {
                    return out;
                }
            }
        }
        out
    }
}

/// A recorded device for tests and measurements: per tick, the readings of each GPU, and the XID
/// events of that tick; past the recording, the last tick repeats.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FakeSource {
    pub ticks: Vec<FakeTick>,
    #[serde(skip)]
    pub at: usize,
}

/// One tick of a [`FakeSource`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FakeTick {
    pub samples: Vec<GpuSample>,
    #[serde(default)]
    pub xids: Vec<XidEvent>,
}

impl FakeSource {
    /// A recording in JSON (`{"ticks": [{"samples": [...], "xids": [...]}]}`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let source: FakeSource =
            serde_json::from_str(text).map_err(|e| format!("bad GPU recording: {e}"))?;
        if source.ticks.is_empty() {
            return Err("bad GPU recording: no ticks".into());
        }
        Ok(source)
    }

    fn tick(&self) -> &FakeTick {
        &self.ticks[self.at.min(self.ticks.len() - 1)]
    }
}

impl GpuSource for FakeSource {
    fn sample(&mut self, gpu: u32) -> Result<GpuSample, String> {
        self.tick()
            .samples
            .iter()
            .find(|s| s.gpu == gpu)
            .cloned()
            .ok_or_else(|| format!("NVML: no GPU {gpu}"))
    }

    fn xid_events(&mut self) -> Vec<XidEvent> {
        let xids = self.tick().xids.clone();
        self.at += 1;
        xids
    }
}

/// Which worker a GPU serves, for messages and labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuOwner {
    pub worker: u32,
    pub role: &'static str,
}

/// Turns readings into warnings: every XID error, and a thermal or power throttle that lasts
/// `sustained` consecutive ticks (once, until it clears).
pub struct Watch {
    sustained: u32,
    throttled: BTreeMap<u32, u32>,
}

impl Watch {
    pub fn new(sustained_ticks: u32) -> Self {
        Self {
            sustained: sustained_ticks.max(1),
            throttled: BTreeMap::new(),
        }
    }

    /// Warnings called for by one tick's readings and XID events.
    pub fn update(
        &mut self,
        samples: &[GpuSample],
        xids: &[XidEvent],
        owner: impl Fn(u32) -> Option<GpuOwner>,
    ) -> Vec<String> {
        let name = |gpu: u32| match owner(gpu) {
            Some(o) => format!("GPU {gpu} (worker {}, {})", o.worker, o.role),
            None => format!("GPU {gpu}"),
        };
        let mut warnings: Vec<String> = xids
            .iter()
            .map(|x| {
                format!(
                    "{}: XID error {}",
                    name(x.gpu),
                    x.xid.map_or("(number unknown)".into(), |v| v.to_string())
                )
            })
            .collect();
        for s in samples {
            let hot: Vec<&str> = s
                .throttle
                .iter()
                .map(String::as_str)
                .filter(|r| HOT_OR_CAPPED.contains(r))
                .collect();
            let run = self.throttled.entry(s.gpu).or_insert(0);
            if hot.is_empty() {
                *run = 0;
                continue;
            }
            *run += 1;
            if *run == self.sustained {
                warnings.push(format!(
                    "{}: throttled ({}) for {} readings in a row{}",
                    name(s.gpu),
                    hot.join(", "),
                    self.sustained,
                    match (s.temperature_c, s.power_w, s.power_limit_w) {
                        (Some(t), Some(p), Some(l)) => format!(" at {t} °C, {p:.0} W of {l:.0} W"),
                        _ => String::new(),
                    }
                ));
            }
        }
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDING: &str = r#"{"ticks": [
        {"samples": [
            {"gpu": 0, "power_w": 612.5, "power_limit_w": 700.0, "energy_j": 1000.0,
             "utilization_pct": 97, "memory_utilization_pct": 40, "memory_used_bytes": 80000000000,
             "memory_total_bytes": 143771000000, "temperature_c": 71, "sm_clock_mhz": 1980,
             "throttle": []},
            {"gpu": 1, "power_w": null, "power_limit_w": null, "energy_j": null,
             "utilization_pct": null, "memory_utilization_pct": null, "memory_used_bytes": null,
             "memory_total_bytes": null, "temperature_c": null, "sm_clock_mhz": null, "throttle": []}
        ]},
        {"samples": [{"gpu": 0, "temperature_c": 89, "power_w": 700.0, "power_limit_w": 700.0,
                      "throttle": ["sw_power_cap", "sw_thermal"]}]},
        {"samples": [{"gpu": 0, "temperature_c": 90, "power_w": 700.0, "power_limit_w": 700.0,
                      "throttle": ["sw_power_cap", "sw_thermal"]}], "xids": [{"gpu": 0, "xid": 79}]},
        {"samples": [{"gpu": 0, "temperature_c": 91, "power_w": 700.0, "power_limit_w": 700.0,
                      "throttle": ["sw_thermal"]}]},
        {"samples": [{"gpu": 0, "throttle": ["gpu_idle"]}]},
        {"samples": [{"gpu": 0, "throttle": ["hw_slowdown"]}]},
        {"samples": [{"gpu": 0, "throttle": ["hw_slowdown"]}]}
    ]}"#;

    fn owner(gpu: u32) -> Option<GpuOwner> {
        (gpu == 0).then_some(GpuOwner {
            worker: 3,
            role: "drafter",
        })
    }

    #[test]
    fn readings_parse_and_missing_values_stay_null() {
        let mut fake = FakeSource::parse(RECORDING).unwrap();
        let a = fake.sample(0).unwrap();
        assert_eq!(a.power_w, Some(612.5));
        assert_eq!(a.memory_total_bytes, Some(143_771_000_000));
        let b = fake.sample(1).unwrap();
        assert_eq!(b.power_w, None);
        assert!(fake.sample(7).unwrap_err().contains("no GPU 7"));
        let json = serde_json::to_value(&b).unwrap();
        assert!(json["power_w"].is_null() && json["temperature_c"].is_null());
    }

    #[test]
    fn sustained_throttle_and_xid_warn_once_naming_gpu_and_worker() {
        let mut fake = FakeSource::parse(RECORDING).unwrap();
        let mut watch = Watch::new(3);
        let mut all = Vec::new();
        for _ in 0..7 {
            let samples = vec![fake.sample(0).unwrap()];
            let xids = fake.xid_events();
            all.push(watch.update(&samples, &xids, owner));
        }
        assert!(all[0].is_empty() && all[1].is_empty());
        assert_eq!(all[2], vec!["GPU 0 (worker 3, drafter): XID error 79"]);
        // Thermal/power throttling in ticks 1, 2 and 3: warned at the third.
        assert_eq!(all[3].len(), 1);
        assert!(
            all[3][0].starts_with("GPU 0 (worker 3, drafter): throttled (sw_thermal)")
                && all[3][0].contains("at 91 °C, 700 W of 700 W"),
            "{:?}",
            all[3]
        );
        // Idle clears it; two hw_slowdown ticks are not yet sustained.
        assert!(all[4].is_empty() && all[5].is_empty() && all[6].is_empty());
        // Past the recording the last tick repeats: the third hw_slowdown tick warns.
        let samples = vec![fake.sample(0).unwrap()];
        let w = watch.update(&samples, &fake.xid_events(), owner);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("throttled (hw_slowdown)"), "{w:?}");
    }

    #[test]
    fn bad_recordings_are_refused() {
        assert!(FakeSource::parse("").is_err());
        assert!(FakeSource::parse(r#"{"ticks": []}"#).is_err());
        assert!(FakeSource::parse(r#"{"ticks": [{"samples": [{"gpu": "x"}]}]}"#).is_err());
    }
}
