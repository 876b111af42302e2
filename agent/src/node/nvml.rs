//! GPUs through NVML. nvml-wrapper opens libnvidia-ml at run time, so a node without the NVIDIA
//! driver (or a build without the `nvml` feature) reports no GPUs and a note saying why; it
//! never fails to start.

use crate::node::discover::Gpu;

/// NVML's NVML_NVLINK_MAX_LINKS (nvml.h): links are numbered below it.
#[cfg(feature = "nvml")]
const MAX_LINKS: u32 = 18;

/// The node's GPUs in NVML order, and a note when there are none for a reason worth telling.
#[cfg(feature = "nvml")]
pub fn gpus() -> (Vec<Gpu>, Option<String>) {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(n) => n,
        Err(e) => return (vec![], Some(format!("NVML unavailable ({e}): no GPUs reported"))),
    };
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => return (vec![], Some(format!("NVML device count failed ({e}): no GPUs reported"))),
    };
    let mut out = vec![];
    for i in 0..count {
        let d = match nvml.device_by_index(i) {
            Ok(d) => d,
            Err(e) => return (out, Some(format!("NVML GPU {i}: {e}; the GPUs from {i} on are left out"))),
        };
        // A link that errors is past the GPU's last one (or NVLink is not supported at all:
        // None, so the planner's default by GPU type applies).
        let mut nvlinks = None;
        for l in 0..MAX_LINKS {
            match d.link_wrapper_for(l).is_active() {
                Ok(active) => *nvlinks.get_or_insert(0) += u32::from(active),
                Err(_) => break,
            }
        }
        out.push(Gpu {
            name: d.name().unwrap_or_else(|_| "unknown".into()),
            memory_bytes: d.memory_info().map(|m| m.total).unwrap_or(0),
            pci_bus_id: d.pci_info().ok().map(|p| p.bus_id),
            nvlinks,
        });
    }
    (out, None)
}

/// NVML, opened once (a heartbeat samples every GPU each base interval); None without a
/// driver.
#[cfg(feature = "nvml")]
fn handle() -> Option<&'static nvml_wrapper::Nvml> {
    static NVML: std::sync::OnceLock<Option<nvml_wrapper::Nvml>> = std::sync::OnceLock::new();
    NVML.get_or_init(|| nvml_wrapper::Nvml::init().ok()).as_ref()
}

/// Each GPU's utilisation, memory and temperature now; empty without NVML. A GPU whose
/// figures cannot be read (fallen off the bus, say) reports zeros.
#[cfg(feature = "nvml")]
pub fn gpu_loads() -> Vec<motley_proto::v1::GpuLoad> {
    let Some(nvml) = handle() else { return vec![] };
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .map(|index| {
            let mut g = motley_proto::v1::GpuLoad { index, ..Default::default() };
            if let Ok(d) = nvml.device_by_index(index) {
                g.utilization_percent = d.utilization_rates().map_or(0, |u| u.gpu);
                if let Ok(m) = d.memory_info() {
                    (g.memory_used_bytes, g.memory_total_bytes) = (m.used, m.total);
                }
                g.temperature_c = d.temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu).ok();
            }
            g
        })
        .collect()
}

#[cfg(not(feature = "nvml"))]
pub fn gpu_loads() -> Vec<motley_proto::v1::GpuLoad> {
    vec![]
}

#[cfg(not(feature = "nvml"))]
pub fn gpus() -> (Vec<Gpu>, Option<String>) {
    (vec![], Some("built without the nvml feature: no GPUs reported".into()))
}
