//! Gang placement of bundles on nodes: all or nothing, with Ray's four strategies.
//! Pure functions over a snapshot of available resources, so every case is unit-tested.
//! The head places with them, and `rlhf-head check` plans with the same calls the driver
//! makes, so the plan it shows is the head's.

use crate::resources::fmt_amount;
use crate::{Error, FailureKind, Resources, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    Pack,
    Spread,
    StrictPack,
    StrictSpread,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Pack => "PACK",
            Strategy::Spread => "SPREAD",
            Strategy::StrictPack => "STRICT_PACK",
            Strategy::StrictSpread => "STRICT_SPREAD",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_uppercase().as_str() {
            "PACK" => Ok(Strategy::Pack),
            "SPREAD" => Ok(Strategy::Spread),
            "STRICT_PACK" => Ok(Strategy::StrictPack),
            "STRICT_SPREAD" => Ok(Strategy::StrictSpread),
            _ => Err(Error::invalid(format!(
                "unknown placement strategy '{s}'; use one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"
            ))),
        }
    }
}

/// One candidate node: its id, a label for messages (hostname or address) and what is free.
#[derive(Debug, Clone)]
pub struct NodeCapacity {
    pub node_id: String,
    pub label: String,
    pub available: Resources,
}

/// Places every bundle or none. Returns the chosen node index (into `nodes`) per bundle,
/// or an `InsufficientResources` error saying what is short, by how much, on which nodes.
pub fn place(
    nodes: &[NodeCapacity],
    bundles: &[Resources],
    strategy: Strategy,
) -> Result<Vec<usize>> {
    if bundles.is_empty() {
        return Err(Error::invalid(
            "a placement group needs at least one bundle",
        ));
    }
    let mut avail: Vec<Resources> = nodes.iter().map(|n| n.available.clone()).collect();
    let found = match strategy {
        Strategy::StrictPack => strict_pack(&avail, bundles),
        Strategy::Pack => {
            strict_pack(&avail, bundles).or_else(|| greedy(&mut avail, bundles, false))
        }
        Strategy::Spread => {
            let mut a = avail.clone();
            distinct(&mut a, bundles).or_else(|| greedy(&mut avail, bundles, true))
        }
        Strategy::StrictSpread => distinct(&mut avail, bundles),
    };
    found.ok_or_else(|| shortfall_error(nodes, bundles, strategy))
}

fn strict_pack(avail: &[Resources], bundles: &[Resources]) -> Option<Vec<usize>> {
    let mut total = Resources::new();
    for b in bundles {
        total.add(b);
    }
    // Tightest node that holds everything, to leave big nodes for big requests.
    avail
        .iter()
        .enumerate()
        .filter(|(_, a)| total.fits_in(a))
        .min_by(|(_, a), (_, b)| slack(a, &total).total_cmp(&slack(b, &total)))
        .map(|(i, _)| vec![i; bundles.len()])
}

fn slack(avail: &Resources, need: &Resources) -> f64 {
    need.0.keys().map(|k| avail.get(k) - need.get(k)).sum()
}

/// Greedy first fit; `spread` prefers the least-used node, otherwise the node already in use.
fn greedy(avail: &mut [Resources], bundles: &[Resources], spread: bool) -> Option<Vec<usize>> {
    let mut used = vec![0usize; avail.len()];
    let mut out = Vec::with_capacity(bundles.len());
    for b in bundles {
        let pick = (0..avail.len())
            .filter(|&i| b.fits_in(&avail[i]))
            .min_by_key(|&i| {
                if spread {
                    (used[i], i)
                } else {
                    (usize::MAX - used[i], i)
                }
            })?;
        avail[pick].sub(b);
        used[pick] += 1;
        out.push(pick);
    }
    Some(out)
}

/// Every bundle on a different node: backtracking matching (clusters are small).
fn distinct(avail: &mut [Resources], bundles: &[Resources]) -> Option<Vec<usize>> {
    fn go(
        i: usize,
        avail: &mut [Resources],
        bundles: &[Resources],
        taken: &mut Vec<bool>,
        out: &mut Vec<usize>,
    ) -> bool {
        if i == bundles.len() {
            return true;
        }
        for n in 0..avail.len() {
            if !taken[n] && bundles[i].fits_in(&avail[n]) {
                taken[n] = true;
                out.push(n);
                if go(i + 1, avail, bundles, taken, out) {
                    return true;
                }
                out.pop();
                taken[n] = false;
            }
        }
        false
    }
    if bundles.len() > avail.len() {
        return None;
    }
    let mut taken = vec![false; avail.len()];
    let mut out = Vec::new();
    go(0, avail, bundles, &mut taken, &mut out).then_some(out)
}

fn shortfall_error(nodes: &[NodeCapacity], bundles: &[Resources], strategy: Strategy) -> Error {
    let mut total = Resources::new();
    for b in bundles {
        total.add(b);
    }
    let mut cluster = Resources::new();
    for n in nodes {
        cluster.add(&n.available);
    }
    let keys: Vec<&String> = total.0.keys().collect();
    let per_node = if nodes.is_empty() {
        "no alive nodes".to_string()
    } else {
        nodes
            .iter()
            .map(|n| {
                let have = keys
                    .iter()
                    .map(|k| format!("{k}: {}", fmt_amount(k, n.available.get(k))))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("{} ({}) has {have}", n.node_id, n.label)
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let short = total.shortfall(&cluster);
    let what = if !short.is_empty() {
        let s = short
            .0
            .iter()
            .map(|(k, v)| format!("{k} by {}", fmt_amount(k, *v)))
            .collect::<Vec<_>>()
            .join(", ");
        format!("short of {s} in total")
    } else {
        match strategy {
            Strategy::StrictSpread => format!(
                "needs {} distinct nodes that each hold one bundle, {} can",
                bundles.len(),
                nodes
                    .iter()
                    .filter(|n| bundles[0].fits_in(&n.available))
                    .count()
            ),
            Strategy::StrictPack => "no single node holds all bundles".to_string(),
            _ => "no node holds one of the bundles".to_string(),
        }
    };
    let bundle_desc = bundles
        .iter()
        .map(|b| format!("{{{}}}", b.display()))
        .collect::<Vec<_>>()
        .join(", ");
    Error::new(
        FailureKind::InsufficientResources,
        format!(
            "cannot place {} bundle(s) [{bundle_desc}] with {}: {what}; available: {per_node}",
            bundles.len(),
            strategy.as_str()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, gpu: f64, cpu: f64) -> NodeCapacity {
        NodeCapacity {
            node_id: id.into(),
            label: format!("{id}.local"),
            available: Resources::new().with("GPU", gpu).with("CPU", cpu),
        }
    }
    fn gpus(n: f64) -> Resources {
        Resources::new().with("GPU", n)
    }

    #[test]
    fn spread_uses_distinct_nodes_when_possible() {
        let nodes = [
            node("a", 8.0, 8.0),
            node("b", 8.0, 8.0),
            node("c", 8.0, 8.0),
        ];
        let p = place(&nodes, &[gpus(1.0), gpus(1.0), gpus(1.0)], Strategy::Spread).unwrap();
        let mut s = p.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 3, "{p:?}");
        // More bundles than nodes: SPREAD still places, STRICT_SPREAD refuses.
        let four = [gpus(1.0), gpus(1.0), gpus(1.0), gpus(1.0)];
        assert_eq!(place(&nodes, &four, Strategy::Spread).unwrap().len(), 4);
        let e = place(&nodes, &four, Strategy::StrictSpread).unwrap_err();
        assert_eq!(e.kind(), FailureKind::InsufficientResources);
        assert!(e.to_string().contains("needs 4 distinct nodes"), "{e}");
    }

    #[test]
    fn pack_prefers_one_node() {
        let nodes = [node("a", 4.0, 8.0), node("b", 8.0, 8.0)];
        // Both PACK and STRICT_PACK pick the tightest node that holds everything.
        assert_eq!(
            place(&nodes, &[gpus(2.0), gpus(2.0)], Strategy::Pack).unwrap(),
            vec![0, 0]
        );
        assert_eq!(
            place(&nodes, &[gpus(3.0), gpus(3.0)], Strategy::StrictPack).unwrap(),
            vec![1, 1]
        );
        // PACK falls back to several nodes; STRICT_PACK refuses.
        let big = [gpus(6.0), gpus(3.0)];
        assert_eq!(place(&nodes, &big, Strategy::Pack).unwrap(), vec![1, 0]);
        let e = place(&nodes, &big, Strategy::StrictPack).unwrap_err();
        assert!(e.to_string().contains("no single node"), "{e}");
    }

    #[test]
    fn strict_spread_backtracks() {
        // Greedy would put the small bundle on the big node first and fail.
        let nodes = [node("big", 4.0, 1.0), node("small", 1.0, 1.0)];
        let p = place(&nodes, &[gpus(1.0), gpus(4.0)], Strategy::StrictSpread).unwrap();
        assert_eq!(p, vec![1, 0]);
    }

    #[test]
    fn all_or_nothing_and_shortfall_is_named() {
        let nodes = [node("a", 2.0, 4.0), node("b", 1.0, 4.0)];
        let e = place(&nodes, &[gpus(2.0), gpus(2.0)], Strategy::Spread).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("short of GPU by 1 in total"), "{m}");
        assert!(
            m.contains("a (a.local) has GPU: 2") && m.contains("b (b.local) has GPU: 1"),
            "{m}"
        );
        assert!(e.kind().retryable());
        let e = place(&[], &[gpus(1.0)], Strategy::Pack).unwrap_err();
        assert!(e.to_string().contains("no alive nodes"), "{e}");
    }

    #[test]
    fn strategy_names_parse() {
        for s in ["PACK", "spread", "STRICT_PACK", "strict_spread"] {
            assert!(Strategy::parse(s).is_ok());
        }
        assert!(Strategy::parse("ROUND_ROBIN")
            .unwrap_err()
            .to_string()
            .contains("STRICT_SPREAD"));
    }
}
