//! Loading: file → `defaults` → overrides → schema check → typed structs →
//! validation.
//!
//! The schema is the default config serialized to YAML, so it cannot drift
//! from the structs. Keys are checked against it before deserialization
//! because serde's own unknown-field errors name neither the full key path
//! nor the line, and cannot see through the flattened role overrides.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

use crate::config::{
    DefaultsEntry, PpoConfig, RoleKind, TrainingConfig, RESERVED_CHAT_TEMPLATE_KWARGS,
};
use crate::error::{ConfigError, Result};
use crate::model::ModelConfig;

/// Role sections that accept every `training` key as an override.
/// The config sections named after roles (each may override `training` keys).
pub(crate) const ROLE_SECTIONS: [&str; 4] = [
    RoleKind::ActorRollout.as_str(),
    RoleKind::Ref.as_str(),
    RoleKind::Critic.as_str(),
    RoleKind::Reward.as_str(),
];

/// Loads `<config_dir>/<config_name>.yaml`, resolves its `defaults`, applies
/// `key.path=value` overrides, checks every key and validates the result.
///
/// `config_name` is given without `.yaml` (a trailing `.yaml` is tolerated).
pub fn load(config_dir: &Path, config_name: &str, overrides: &[String]) -> Result<PpoConfig> {
    let name = config_name.strip_suffix(".yaml").unwrap_or(config_name);
    let path = config_dir.join(format!("{name}.yaml"));
    if !path.is_file() {
        let mut names: Vec<String> = std::fs::read_dir(config_dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let p = e.path();
                        (p.extension().is_some_and(|x| x == "yaml"))
                            .then(|| p.file_stem()?.to_str().map(str::to_string))
                            .flatten()
                    })
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        return Err(ConfigError::Model {
            origin: path.display().to_string(),
            reason: format!(
                "no such config; --config-name takes one of [{}] from --config-dir {}",
                names.join(", "),
                config_dir.display()
            ),
        });
    }
    load_file(&path, overrides)
}

/// Loads a config file by path; `defaults` resolve against the file's directory.
pub fn load_file(path: &Path, overrides: &[String]) -> Result<PpoConfig> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut cfg = from_yaml_str(&text, &path.display().to_string(), dir, overrides)?;
    cfg.source = Some(path.to_path_buf());
    Ok(cfg)
}

/// Parses, checks and validates config text. `origin` names the text in
/// errors; `config_dir` is where `model/<name>.yaml` files are looked up.
pub fn from_yaml_str(
    text: &str,
    origin: &str,
    config_dir: &Path,
    overrides: &[String],
) -> Result<PpoConfig> {
    from_yaml_with(text, origin, overrides, &|name| {
        load_model(config_dir, name)
    })
}

/// Parses a self-contained config made by [`PpoConfig::to_bundle`] (the
/// resolved YAML plus its model configs), e.g. on a head that has no
/// `configs/` directory. The config is checked and validated again.
pub fn from_bundle(bundle: &str) -> Result<PpoConfig> {
    let b: ConfigBundle = serde_json::from_str(bundle).map_err(|e| ConfigError::Model {
        origin: "config bundle".into(),
        reason: format!("not a config bundle: {e}"),
    })?;
    let mut cfg = from_yaml_with(&b.config, "config bundle", &[], &|name| {
        b.models
            .get(name)
            .cloned()
            .ok_or_else(|| ConfigError::Model {
                origin: "config bundle".into(),
                reason: format!("defaults names model '{name}' but the bundle does not carry it"),
            })
    })?;
    cfg.source = b.source.map(PathBuf::from);
    Ok(cfg)
}

/// What [`PpoConfig::to_bundle`] writes.
#[derive(serde::Serialize, serde::Deserialize)]
struct ConfigBundle {
    config: String,
    models: std::collections::BTreeMap<String, ModelConfig>,
    source: Option<String>,
}

impl PpoConfig {
    /// The resolved config and the model configs it names, as one JSON
    /// string that [`from_bundle`] turns back into this config without any
    /// files (for `submit` to a remote head).
    pub fn to_bundle(&self) -> String {
        let b = ConfigBundle {
            config: self.to_yaml(),
            models: self.models.clone(),
            source: self.source.as_ref().map(|p| p.display().to_string()),
        };
        serde_json::to_string(&b).unwrap_or_default()
    }
}

fn from_yaml_with(
    text: &str,
    origin: &str,
    overrides: &[String],
    model_source: &dyn Fn(&str) -> Result<ModelConfig>,
) -> Result<PpoConfig> {
    let mut root: Value = parse_yaml(text, origin)?;
    if root.is_null() {
        root = Value::Mapping(Mapping::new());
    }
    let Value::Mapping(map) = &mut root else {
        return Err(ConfigError::BadValue {
            origin: origin.into(),
            key: "<root>".into(),
            line: Some(1),
            expected: "a mapping of sections (training, resource_pool, ...)".into(),
            got: kind_name(&root).into(),
        });
    };
    let defaults_value = map.remove("defaults").unwrap_or(Value::Sequence(vec![]));
    let defaults: Vec<DefaultsEntry> = typed(defaults_value, origin, text, "defaults")?;

    let schema = config_schema();
    check_keys(&root, &schema, &schema, &mut Vec::new(), origin, text)?;
    for o in overrides {
        apply_override(&mut root, &schema, o)?;
    }

    let mut cfg: PpoConfig = typed(root, origin, text, "")?;
    cfg.defaults = defaults;
    for entry in &cfg.defaults {
        for name in entry.model.names() {
            let model = model_source(name)?;
            cfg.models.insert(name.to_string(), model);
        }
    }
    crate::validate::validate(&cfg, origin)?;
    Ok(cfg)
}

/// Reads `<config_dir>/model/<name>.yaml`.
pub fn load_model(config_dir: &Path, name: &str) -> Result<ModelConfig> {
    let path: PathBuf = config_dir.join("model").join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
        path: path.clone(),
        source,
    })?;
    let origin = path.display().to_string();
    let value = parse_yaml(&text, &origin)?;
    let schema = serde_norway::to_value(ModelConfig::default()).unwrap_or(Value::Null);
    check_keys(&value, &schema, &schema, &mut Vec::new(), &origin, &text)?;
    let model: ModelConfig = typed(value, &origin, &text, "")?;
    let problems = model.problems(&format!("model/{name}"));
    if !problems.is_empty() {
        return Err(ConfigError::Invalid {
            origin,
            errors: problems,
        });
    }
    Ok(model)
}

/// Every valid key of a job config, as a YAML tree of defaults. Role sections
/// also carry the `training` keys they may override.
pub fn config_schema() -> Value {
    let mut v = serde_norway::to_value(PpoConfig::default()).unwrap_or(Value::Null);
    let training = serde_norway::to_value(TrainingConfig::default()).unwrap_or(Value::Null);
    if let Value::Mapping(root) = &mut v {
        root.shift_remove("defaults");
        for section in ROLE_SECTIONS {
            if let (Some(Value::Mapping(sec)), Value::Mapping(t)) =
                (root.get_mut(section), &training)
            {
                for (k, val) in t {
                    sec.entry(k.clone()).or_insert_with(|| val.clone());
                }
            }
        }
    }
    v
}

fn parse_yaml(text: &str, origin: &str) -> Result<Value> {
    serde_norway::from_str(text).map_err(|e| ConfigError::Yaml {
        origin: origin.into(),
        line: e.location().map(|l| l.line()),
        message: e.to_string(),
    })
}

/// Deserializes with the failing key path attached to the error.
fn typed<T: DeserializeOwned>(value: Value, origin: &str, text: &str, prefix: &str) -> Result<T> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let inner = e.path().to_string();
        let key = match (prefix.is_empty(), inner == ".") {
            (true, _) => inner,
            (false, true) => prefix.to_string(),
            (false, false) if inner.starts_with('[') => format!("{prefix}{inner}"),
            (false, false) => format!("{prefix}.{inner}"),
        };
        let segs: Vec<String> = key.split('.').map(str::to_string).collect();
        let message = e.inner().to_string();
        if let Some(rest) = message.strip_prefix("unknown field `") {
            // serde: "unknown field `x`, expected `a`" / "expected one of `a`, `b`".
            let mut parts = rest.split('`');
            let field = parts.next().unwrap_or_default().to_string();
            let valid: Vec<&str> = parts.skip(1).step_by(2).collect();
            // The path already ends with the unknown field.
            let parent = key
                .strip_suffix(&field)
                .map(|p| p.trim_end_matches('.'))
                .unwrap_or(&key);
            let suggestion = valid
                .iter()
                .min_by_key(|v| levenshtein(&field, v))
                .map(|v| format!("{parent}.{v}"));
            return ConfigError::UnknownKey {
                origin: origin.into(),
                line: None,
                key,
                suggestion,
            };
        }
        ConfigError::BadValue {
            origin: origin.into(),
            line: find_key_line(text, &segs),
            key,
            expected: "a value of the documented type (see configs/README.md)".into(),
            got: e.into_inner().to_string(),
        }
    })
}

pub(crate) fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

fn key_str(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => serde_norway::to_string(other)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    }
}

/// The key whose mapping holds names of the user's choosing (chat template variables),
/// checked by [`check_template_var`] instead of against the schema's names.
const TEMPLATE_VARS_KEY: &str = "data.chat_template_kwargs";

fn is_template_vars(path: &[String]) -> bool {
    path.join(".") == TEMPLATE_VARS_KEY
}

/// One entry of `data.chat_template_kwargs` (`path` ends with its name): a scalar, under a
/// name the renderer does not set itself.
fn check_template_var(path: &[String], value: &Value, origin: &str, text: &str) -> Result<()> {
    let name = path.last().map(String::as_str).unwrap_or_default();
    let bad = |expected: String, got: String| ConfigError::BadValue {
        origin: origin.into(),
        key: path.join("."),
        line: find_key_line(text, path),
        expected,
        got,
    };
    if RESERVED_CHAT_TEMPLATE_KWARGS.contains(&name) {
        return Err(bad(
            format!(
                "a variable other than {} (the renderer sets those itself)",
                RESERVED_CHAT_TEMPLATE_KWARGS.join(", ")
            ),
            format!("the reserved name '{name}'"),
        ));
    }
    match value {
        Value::Bool(_) | Value::Number(_) | Value::String(_) => Ok(()),
        other => Err(bad(
            "a boolean, number or string, passed to the chat template as a variable \
             (e.g. enable_thinking: false)"
                .into(),
            format!("{} ({})", kind_name(other), short(other)),
        )),
    }
}

/// Walks `value` against `schema`: unknown keys and scalar kinds that can
/// never deserialize are reported with the full path and the line.
fn check_keys(
    value: &Value,
    schema: &Value,
    root: &Value,
    path: &mut Vec<String>,
    origin: &str,
    text: &str,
) -> Result<()> {
    match (value, schema) {
        (Value::Mapping(vm), Value::Mapping(_)) if is_template_vars(path) => {
            for (k, v) in vm {
                path.push(key_str(k));
                check_template_var(path, v, origin, text)?;
                path.pop();
            }
            Ok(())
        }
        (Value::Mapping(vm), Value::Mapping(sm)) => {
            for (k, v) in vm {
                let key = key_str(k);
                path.push(key.clone());
                match sm.get(k) {
                    Some(s) => check_keys(v, s, root, path, origin, text)?,
                    None => {
                        return Err(ConfigError::UnknownKey {
                            origin: origin.into(),
                            line: find_key_line(text, path),
                            key: path.join("."),
                            suggestion: suggest(&path[..path.len() - 1], &key, sm)
                                .or_else(|| elsewhere(root, &key)),
                        });
                    }
                }
                path.pop();
            }
            Ok(())
        }
        (v, s) => match kind_mismatch(v, s) {
            Some(expected) => Err(ConfigError::BadValue {
                origin: origin.into(),
                key: path.join("."),
                line: find_key_line(text, path),
                expected: expected.into(),
                got: format!("{} ({})", kind_name(v), short(v)),
            }),
            None => Ok(()),
        },
    }
}

/// The expected kind when `v` can never fit the schema default `s`.
/// Null user values are left to serde (they are valid for optional keys).
fn kind_mismatch(v: &Value, s: &Value) -> Option<&'static str> {
    if v.is_null() {
        return None;
    }
    match s {
        Value::Bool(_) if !v.is_bool() => Some("a boolean (true or false)"),
        Value::Number(n) if n.is_f64() && !v.is_number() => Some("a number"),
        Value::Number(n) if !n.is_f64() && v.as_u64().is_none() => Some("a non-negative integer"),
        Value::String(_) if !v.is_string() => Some("a string"),
        Value::Mapping(_) if !v.is_mapping() => Some("a mapping of keys"),
        Value::Sequence(_) if !v.is_sequence() => Some("a list"),
        _ => None,
    }
}

fn short(v: &Value) -> String {
    let s = serde_norway::to_string(v).unwrap_or_default();
    let s = s.trim().replace('\n', " ");
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

/// Closest sibling key (edit distance, or a prefix), as a full path.
fn suggest(parent: &[String], key: &str, siblings: &Mapping) -> Option<String> {
    let full = |k: &str| {
        let mut p = parent.to_vec();
        p.push(k.to_string());
        p.join(".")
    };
    let limit = (key.chars().count() / 3).max(2);
    let mut best: Option<(usize, String)> = None;
    for k in siblings.keys() {
        let k = key_str(k);
        let d = levenshtein(key, &k);
        let prefix = key.len() >= 3 && (k.starts_with(key) || key.starts_with(&k));
        if (d <= limit || prefix) && best.as_ref().is_none_or(|(bd, _)| d < *bd) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| full(&k))
}

/// The first full path in `root` whose last segment is exactly `key`: a
/// valid key written in the wrong section (`critic.ppo_epochs`).
fn elsewhere(root: &Value, key: &str) -> Option<String> {
    fn walk(v: &Value, path: &mut Vec<String>, key: &str) -> Option<String> {
        let Value::Mapping(m) = v else { return None };
        for (k, child) in m {
            let k = key_str(k);
            path.push(k.clone());
            if k == key {
                return Some(path.join("."));
            }
            if let Some(found) = walk(child, path, key) {
                return Some(found);
            }
            path.pop();
        }
        None
    }
    walk(root, &mut Vec::new(), key)
}

/// Classic edit distance (insert, delete, substitute), on chars.
pub(crate) fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// 1-based line of a block-style key path in YAML text, found by indentation.
/// Flow mappings and anchors are not followed (the line is then omitted).
pub(crate) fn find_key_line(text: &str, path: &[String]) -> Option<usize> {
    if path.is_empty() {
        return None;
    }
    let mut depth = 0;
    let mut parent_indent: Option<usize> = None;
    // Indentation of the current block's direct children, set by its first line.
    let mut child_indent: Option<usize> = None;
    for (no, raw) in text.lines().enumerate() {
        let trimmed = raw.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with("---") {
            continue;
        }
        let indent = raw.len() - trimmed.len();
        if parent_indent.is_some_and(|pi| indent <= pi) {
            return None; // left the parent block without finding the key
        }
        let ci = *child_indent.get_or_insert(indent);
        if indent != ci {
            continue;
        }
        let want = &path[depth];
        let matches = [
            format!("{want}:"),
            format!("\"{want}\":"),
            format!("'{want}':"),
        ]
        .iter()
        .any(|p| trimmed.starts_with(p.as_str()));
        if matches {
            if depth + 1 == path.len() {
                return Some(no + 1);
            }
            depth += 1;
            parent_indent = Some(indent);
            child_indent = None;
        }
    }
    None
}

/// Applies one `key.path=value` override; the path must exist in the schema.
fn apply_override(root: &mut Value, schema: &Value, text: &str) -> Result<()> {
    let origin = format!("override '{text}'");
    let Some((key, raw)) = text.split_once('=') else {
        return Err(ConfigError::BadOverride {
            text: text.into(),
            reason: "expected key.path=value, e.g. actor_rollout.ppo_epochs=2".into(),
        });
    };
    let key = key.trim();
    let segs: Vec<String> = key.split('.').map(str::to_string).collect();
    if key.is_empty() || segs.iter().any(String::is_empty) {
        return Err(ConfigError::BadOverride {
            text: text.into(),
            reason: "the key path is empty or has an empty segment; write section.key=value".into(),
        });
    }
    let value: Value = serde_norway::from_str(raw).map_err(|e| ConfigError::BadOverride {
        text: text.into(),
        reason: format!("the value is not a YAML scalar or list: {e}"),
    })?;

    // Walk the schema first so a typo is reported before anything changes.
    let mut s = schema;
    for (i, seg) in segs.iter().enumerate() {
        if is_template_vars(&segs[..i]) {
            // A chat template variable by name: data.chat_template_kwargs.enable_thinking=false.
            if i + 1 != segs.len() {
                return Err(ConfigError::BadOverride {
                    text: text.into(),
                    reason: format!(
                        "{TEMPLATE_VARS_KEY} holds scalars by name; write {TEMPLATE_VARS_KEY}.NAME=value"
                    ),
                });
            }
            check_template_var(&segs, &value, &origin, "")?;
            set_path(root, &segs, value);
            return Ok(());
        }
        let next = s.as_mapping().and_then(|m| m.get(seg.as_str()));
        match next {
            Some(n) => s = n,
            None => {
                let suggestion = s
                    .as_mapping()
                    .and_then(|m| suggest(&segs[..i], seg, m))
                    .or_else(|| elsewhere(schema, seg));
                return Err(ConfigError::UnknownKey {
                    origin,
                    key: segs[..=i].join("."),
                    line: None,
                    suggestion,
                });
            }
        }
    }
    if let Some(expected) = kind_mismatch(&value, s) {
        return Err(ConfigError::BadValue {
            origin,
            key: key.into(),
            line: None,
            expected: expected.into(),
            got: format!("{} ({})", kind_name(&value), short(&value)),
        });
    }
    if value.is_mapping() {
        check_keys(&value, s, schema, &mut segs.clone(), &origin, "")?;
    }

    set_path(root, &segs, value);
    Ok(())
}

/// Sets `path` in a YAML tree, creating (or replacing non-mapping) parents.
fn set_path(node: &mut Value, path: &[String], value: Value) {
    if !node.is_mapping() {
        *node = Value::Mapping(Mapping::new());
    }
    if let (Value::Mapping(m), Some((first, rest))) = (node, path.split_first()) {
        let key = Value::String(first.clone());
        if rest.is_empty() {
            m.insert(key, value);
        } else {
            let child = m.entry(key).or_insert(Value::Null);
            set_path(child, rest, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance() {
        assert_eq!(levenshtein("ppo_epoch", "ppo_epochs"), 1);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("same", "same"), 0);
    }

    #[test]
    fn key_lines_follow_indentation() {
        let text = "a:\n  x: 1\n  b:\n    x: 9\nb:\n  # note\n  x: 2\n  c:\n    x: 3\n";
        let p = |s: &str| s.split('.').map(str::to_string).collect::<Vec<_>>();
        assert_eq!(find_key_line(text, &p("a.x")), Some(2));
        assert_eq!(find_key_line(text, &p("a.b.x")), Some(4));
        assert_eq!(find_key_line(text, &p("b.x")), Some(7));
        assert_eq!(find_key_line(text, &p("b.c.x")), Some(9));
        assert_eq!(find_key_line(text, &p("a.c")), None);
    }
}
