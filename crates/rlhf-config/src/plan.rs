//! The placement plan for `check`: which role goes to which node with how many devices.
//! It makes the driver's requests (one PACK group of one-device bundles per role, in role
//! order) through the head's own placement function, so it shows what the head will do,
//! and answers "does the job fit this cluster, and if not, what is missing" before anything
//! starts.

use std::collections::BTreeMap;
use std::fmt;

use rlhf_core::placement::{place, NodeCapacity, Strategy};
use rlhf_core::Resources;

use crate::config::{PpoConfig, RoleKind};
use crate::error::{ConfigError, Result};

/// One role's share on one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// The role.
    pub role: RoleKind,
    /// Node name as given to [`PpoConfig::placement_plan`].
    pub node: String,
    /// Bundles (role processes) placed there, each holding `share` of a device of the
    /// pool's resource (0 bundles = runs on the node's CPU without a device, e.g. a rule
    /// reward).
    pub devices: u32,
    /// Device share per bundle: 1, or less under `resource_pool.colocate`.
    pub share: f64,
}

/// Where every role runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Resource the devices are counted in (`GPU`, `NPU`, `CPU`).
    pub resource: String,
    /// Assignments, grouped by role in placement order.
    pub assignments: Vec<Assignment>,
}

impl Plan {
    /// Devices a node gives the job.
    pub fn devices_on(&self, node: &str) -> u32 {
        self.assignments
            .iter()
            .filter(|a| a.node == node)
            .map(|a| a.devices)
            .sum()
    }

    /// The assignments of a role.
    pub fn of(&self, role: RoleKind) -> Vec<&Assignment> {
        self.assignments.iter().filter(|a| a.role == role).collect()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<14} {:<20} {:>8}", "role", "node", self.resource)?;
        for a in &self.assignments {
            let amount = if a.share < 1.0 && a.devices > 0 {
                format!("{} x {}", a.devices, a.share)
            } else {
                a.devices.to_string()
            };
            writeln!(f, "{:<14} {:<20} {:>8}", a.role.as_str(), a.node, amount)?;
        }
        Ok(())
    }
}

impl PpoConfig {
    /// Places every enabled role on `nodes` (name, free resources by name) as the driver
    /// asks the head to: role by role, each a PACK placement group of one-device bundles
    /// (on the tightest node that holds it all, else first fit), through the head's
    /// placement function. Refuses, naming the resource and the shortfall, when the
    /// cluster has fewer free devices than the pool asks for.
    pub fn placement_plan(&self, nodes: &[(String, BTreeMap<String, f64>)]) -> Result<Plan> {
        let resource = self.resource_pool.device.resource().to_string();
        let free: Vec<(String, u32)> = nodes
            .iter()
            .map(|(n, r)| {
                let v = r.get(&resource).copied().unwrap_or(0.0);
                // Fractional devices cannot host a rank; negative means none.
                (
                    n.clone(),
                    if v.is_finite() && v > 0.0 {
                        v.floor() as u32
                    } else {
                        0
                    },
                )
            })
            .collect();
        let roles: Vec<(RoleKind, u32, f64)> = RoleKind::ALL
            .iter()
            .filter(|r| self.role_enabled(**r))
            .map(|r| {
                let (n, share) = self.role_bundles(*r);
                (*r, n, share)
            })
            .collect();
        // Whole devices the pool asks for: the sum of its shares, rounded up.
        let required = roles
            .iter()
            .map(|(_, n, share)| f64::from(*n) * share)
            .sum::<f64>()
            .ceil() as u32;
        // Saturating: a node may announce any amount up to the head's bound.
        let available = free.iter().fold(0u32, |a, (_, n)| a.saturating_add(*n));
        let needs: Vec<String> = roles
            .iter()
            .filter(|(_, n, _)| *n > 0)
            .map(|(r, n, share)| {
                if *share < 1.0 {
                    format!("{r} {n} x {share}")
                } else {
                    format!("{r} {n}")
                }
            })
            .collect();
        if nodes.is_empty() || required > available {
            return Err(ConfigError::Placement {
                resource: resource.clone(),
                required: f64::from(required),
                available: f64::from(available),
                shortfall: f64::from(required.saturating_sub(available)),
                detail: format!(
                    "resource_pool asks for {} on {} node(s); add {} or lower resource_pool.*",
                    needs.join(" + "),
                    nodes.len(),
                    if nodes.is_empty() {
                        "a node".to_string()
                    } else {
                        format!("{} {resource}", required - available)
                    }
                ),
            });
        }
        let mut caps: Vec<NodeCapacity> = free
            .iter()
            .map(|(n, f)| NodeCapacity {
                node_id: n.clone(),
                label: n.clone(),
                available: Resources::new().with(&resource, f64::from(*f)),
            })
            .collect();
        let mut assignments = Vec::new();
        for (role, need, share) in roles {
            if need == 0 {
                assignments.push(Assignment {
                    role,
                    node: free[0].0.clone(),
                    devices: 0,
                    share: 1.0,
                });
                continue;
            }
            let bundle = Resources::new().with(&resource, share);
            let chosen = place(&caps, &vec![bundle.clone(); need as usize], Strategy::Pack)
                .map_err(|e| ConfigError::Placement {
                    resource: resource.clone(),
                    required: f64::from(need),
                    available: caps.iter().map(|c| c.available.get(&resource)).sum(),
                    shortfall: 0.0,
                    detail: format!("placing {role}: {e}"),
                })?;
            let mut per_node: BTreeMap<usize, u32> = BTreeMap::new();
            for i in chosen {
                caps[i].available.sub(&bundle);
                *per_node.entry(i).or_default() += 1;
            }
            for (i, devices) in per_node {
                assignments.push(Assignment {
                    role,
                    node: caps[i].node_id.clone(),
                    devices,
                    share,
                });
            }
        }
        // Present in role order, whatever order they were packed in.
        assignments.sort_by_key(|a| a.role);
        Ok(Plan {
            resource,
            assignments,
        })
    }
}
