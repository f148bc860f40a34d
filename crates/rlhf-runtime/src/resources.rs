//! What a node contributes: CPU cores, memory, NVIDIA GPUs and Ascend NPUs, detected,
//! then added to or overridden by `--resources`.

use rlhf_core::Resources;

/// Device indices a worker hands out to its actors.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Devices {
    pub gpus: Vec<u32>,
    pub npus: Vec<u32>,
}

/// Devices granted to one actor: `(index, amount)`, the amount 1 for a whole device or a
/// share of one (a fractional bundle of a colocated job).
pub type Grant = Vec<(u32, f64)>;

/// The device indices of one kind a worker hands out, whole or in shares. A share goes to
/// the first device already shared that has room (so colocated actors land together), else
/// to a free device; a device returns to the free list when its last share is given back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DevicePool {
    free: Vec<u32>,
    /// Devices handed out in shares, with the amount in use.
    shared: Vec<(u32, f64)>,
}

/// Room for rounding when shares add up to a whole device (three thirds).
const SHARE_SLACK: f64 = 1e-9;

impl DevicePool {
    pub fn new(mut ids: Vec<u32>) -> Self {
        ids.sort_unstable();
        Self {
            free: ids,
            shared: Vec::new(),
        }
    }

    /// Whole devices free.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Takes `amount` of devices: `ceil(amount)` whole ones from 1 up, a share of one below
    /// (none for 0). `None` when the pool cannot give it.
    pub fn take(&mut self, amount: f64) -> Option<Grant> {
        if !(amount.is_finite() && amount > 0.0) {
            return Some(Vec::new());
        }
        if amount >= 1.0 {
            let n = amount.ceil() as usize;
            if n > self.free.len() {
                return None;
            }
            return Some(self.free.drain(..n).map(|d| (d, 1.0)).collect());
        }
        if let Some(s) = self
            .shared
            .iter_mut()
            .find(|(_, used)| *used + amount <= 1.0 + SHARE_SLACK)
        {
            s.1 += amount;
            return Some(vec![(s.0, amount)]);
        }
        if self.free.is_empty() {
            return None;
        }
        let d = self.free.remove(0);
        self.shared.push((d, amount));
        Some(vec![(d, amount)])
    }

    /// Returns what [`DevicePool::take`] granted.
    pub fn give_back(&mut self, grant: &[(u32, f64)]) {
        for &(d, amount) in grant {
            if amount >= 1.0 {
                self.free.push(d);
                continue;
            }
            if let Some(i) = self.shared.iter().position(|(s, _)| *s == d) {
                self.shared[i].1 -= amount;
                if self.shared[i].1 <= SHARE_SLACK {
                    self.shared.remove(i);
                    self.free.push(d);
                }
            }
        }
        self.free.sort_unstable();
    }
}

/// The device indices of a grant, for `CUDA_VISIBLE_DEVICES`.
pub fn grant_ids(grant: &[(u32, f64)]) -> Vec<u32> {
    grant.iter().map(|&(d, _)| d).collect()
}

/// Parses a `CUDA_VISIBLE_DEVICES`-style list. Empty or "-1"-style values mean no device.
pub fn parse_visible(v: &str) -> Vec<u32> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map_while(|s| s.parse::<i64>().ok().filter(|n| *n >= 0).map(|n| n as u32))
        .collect()
}

fn nvidia_smi_count() -> usize {
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

fn mem_total_bytes() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// Detects devices from the environment (`CUDA_VISIBLE_DEVICES`, nvidia-smi,
/// `ASCEND_RT_VISIBLE_DEVICES`) via `env`, so tests can inject values.
pub fn detect_devices(
    env: impl Fn(&str) -> Option<String>,
    smi_count: impl Fn() -> usize,
) -> Devices {
    let gpus = match env("CUDA_VISIBLE_DEVICES") {
        Some(v) => parse_visible(&v),
        None => (0..smi_count() as u32).collect(),
    };
    let npus = env("ASCEND_RT_VISIBLE_DEVICES")
        .map(|v| parse_visible(&v))
        .unwrap_or_default();
    Devices { gpus, npus }
}

/// Most GPUs or NPUs one node may offer: each is an entry of the worker's device table.
pub const MAX_DEVICES: f64 = 1024.0;

/// Checks the device counts of `--resources` (`flag`) before a worker builds its device
/// table from them.
pub fn check_overrides(flag: &str, overrides: &Resources) -> rlhf_core::Result<()> {
    for key in ["GPU", "NPU"] {
        let n = overrides.get(key);
        if n > MAX_DEVICES {
            return Err(rlhf_core::Error::invalid(format!(
                "{flag}: \"{key}\": {n} is more devices than a node can offer (at most {MAX_DEVICES})"
            )));
        }
    }
    Ok(())
}

/// Detected resources, overridden key by key with `overrides` (checked by
/// [`check_overrides`]). When GPU/NPU counts are overridden beyond what was detected, device
/// indices 0..n are assumed.
pub fn node_resources(overrides: &Resources) -> (Resources, Devices) {
    let mut devices = detect_devices(|k| std::env::var(k).ok(), nvidia_smi_count);
    let mut r = Resources::new();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    r.0.insert("CPU".into(), cpus as f64);
    if let Some(m) = mem_total_bytes() {
        r.0.insert("memory".into(), m);
    }
    if !devices.gpus.is_empty() {
        r.0.insert("GPU".into(), devices.gpus.len() as f64);
    }
    if !devices.npus.is_empty() {
        r.0.insert("NPU".into(), devices.npus.len() as f64);
    }
    r.override_with(overrides);
    for (key, list) in [("GPU", &mut devices.gpus), ("NPU", &mut devices.npus)] {
        let want = r.get(key).floor() as usize;
        if want > list.len() {
            let start = list.iter().max().map_or(0, |m| m.saturating_add(1));
            let more = want - list.len();
            list.extend((0..more).map(|i| start.saturating_add(i as u32)));
        }
        list.truncate(want);
    }
    (r, devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_parse() {
        assert_eq!(parse_visible("0,2, 3"), vec![0, 2, 3]);
        assert_eq!(parse_visible(""), Vec::<u32>::new());
        assert_eq!(parse_visible("-1"), Vec::<u32>::new());
    }

    #[test]
    fn detection_reads_env_then_smi() {
        let d = detect_devices(
            |k| (k == "CUDA_VISIBLE_DEVICES").then(|| "4,5".to_string()),
            || 8,
        );
        assert_eq!(d.gpus, vec![4, 5]);
        let d = detect_devices(
            |k| (k == "ASCEND_RT_VISIBLE_DEVICES").then(|| "0,1,2".to_string()),
            || 2,
        );
        assert_eq!(d.gpus, vec![0, 1]);
        assert_eq!(d.npus, vec![0, 1, 2]);
    }

    #[test]
    fn overrides_win_and_custom_keys_pass_through() {
        let o = Resources::new()
            .with("GPU", 3.0)
            .with("my_accel", 2.0)
            .with("CPU", 1.0);
        let (r, d) = node_resources(&o);
        assert_eq!(r.get("GPU"), 3.0);
        assert_eq!(r.get("CPU"), 1.0);
        assert_eq!(r.get("my_accel"), 2.0);
        assert_eq!(d.gpus.len(), 3);
        assert!(r.get("memory") > 0.0);
        let absurd = Resources::new().with("GPU", 4294967296.0);
        let e = check_overrides("--resources", &absurd).unwrap_err();
        assert!(e.to_string().contains("at most 1024"), "{e}");
        assert!(check_overrides("--resources", &o).is_ok());
    }

    #[test]
    fn shares_of_a_device_land_together_and_whole_devices_stay_whole() {
        let mut p = DevicePool::new(vec![3, 1]);
        // Three thirds (as a colocated job asks: 0.333 each) share device 1.
        let a = p.take(0.333).unwrap();
        let b = p.take(0.333).unwrap();
        let c = p.take(0.333).unwrap();
        assert_eq!(grant_ids(&a), vec![1]);
        assert_eq!(grant_ids(&b), vec![1]);
        assert_eq!(grant_ids(&c), vec![1]);
        assert_eq!(p.free(), 1);
        // A fourth share does not fit device 1: it opens device 3.
        let d = p.take(0.5).unwrap();
        assert_eq!(grant_ids(&d), vec![3]);
        // No whole device is left, and none comes back until every share of it is returned.
        assert!(p.take(1.0).is_none());
        p.give_back(&a);
        p.give_back(&b);
        assert!(p.take(1.0).is_none());
        p.give_back(&c);
        assert_eq!(grant_ids(&p.take(1.0).unwrap()), vec![1]);
        p.give_back(&d);
        assert_eq!(p.free(), 1);
        // Zero asks for nothing; two asks for two whole devices.
        assert_eq!(p.take(0.0).unwrap(), vec![]);
        assert!(p.take(2.0).is_none());
        // Four quarters fill one device exactly.
        let mut q = DevicePool::new(vec![0]);
        let grants: Vec<Grant> = (0..4).map(|_| q.take(0.25).unwrap()).collect();
        assert!(grants.iter().all(|g| grant_ids(g) == vec![0]));
        assert!(q.take(0.25).is_none());
    }
}
