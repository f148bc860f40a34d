//! HF chat templates rendered with minijinja configured like transformers' sandbox
//! (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, a Python-style `tojson`)
//! plus the Python string and dict methods HF templates call (`.strip()`, `.items()`, ...).
//! The variables are transformers' too: `messages`, `add_generation_prompt`, `tools` and
//! `documents` (none unless given), the special tokens, and any extra keyword arguments of
//! `apply_chat_template` (Qwen3's `enable_thinking`).
//!
//! JSON objects keep their keys sorted (serde_json's map), so a template printing a whole
//! object (`tool | tojson`) prints its keys sorted where transformers keeps Python's order.

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, State, Value as JValue};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Variables the renderer sets itself, which extra template variables cannot replace
/// (transformers passes them as keyword arguments of their own: a second value is an error).
pub const RESERVED_TEMPLATE_VARS: &[&str] = &["messages", "add_generation_prompt"];

/// Renders an HF chat template.
pub fn render_chat_template(
    template: &str,
    messages: &Value,
    add_generation_prompt: bool,
    special_tokens: &[(&str, Option<&str>)],
) -> Result<String> {
    render_chat_template_with(
        template,
        messages,
        add_generation_prompt,
        special_tokens,
        &Map::new(),
    )
}

/// Renders an HF chat template with extra variables, as transformers'
/// `apply_chat_template(..., **kwargs)`: `enable_thinking`, `tools`, `documents`, ... They
/// override the special tokens of the same name (as in transformers); `messages` and
/// `add_generation_prompt` are refused ([`RESERVED_TEMPLATE_VARS`]).
pub fn render_chat_template_with(
    template: &str,
    messages: &Value,
    add_generation_prompt: bool,
    special_tokens: &[(&str, Option<&str>)],
    extra: &Map<String, Value>,
) -> Result<String> {
    if let Some(name) = RESERVED_TEMPLATE_VARS
        .iter()
        .find(|n| extra.contains_key(**n))
    {
        return Err(Error::Template(format!(
            "the chat template variable {name} is set by the renderer itself and cannot be passed as an extra variable"
        )));
    }
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<JValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime_now(&fmt)
    });
    env.add_filter("tojson", tojson);
    env.set_unknown_method_callback(python_methods);
    env.add_template("chat", template)
        .map_err(|e| Error::Template(format!("cannot parse chat template: {e}")))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| Error::Template(e.to_string()))?;
    let mut ctx = Map::new();
    ctx.insert("messages".into(), messages.clone());
    ctx.insert(
        "add_generation_prompt".into(),
        Value::Bool(add_generation_prompt),
    );
    // transformers always passes these two, None when not given: `tools is none` holds.
    ctx.insert("tools".into(), Value::Null);
    ctx.insert("documents".into(), Value::Null);
    for (k, v) in special_tokens {
        if let Some(v) = v {
            ctx.insert((*k).into(), Value::String((*v).to_string()));
        }
    }
    ctx.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    tmpl.render(JValue::from_serialize(&ctx))
        .map_err(|e| Error::Template(format!("cannot render chat template: {e}")))
}

/// Only the date formats templates use in practice (Llama 3.1 `"%d %b %Y"`); UTC.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    const FULL: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let mi = (m - 1) as usize;
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%b", MONTHS[mi])
        .replace("%B", FULL[mi])
}

/// Widest `tojson(indent=...)` honoured; wider is written with this one.
const MAX_INDENT: usize = 64;

/// Python `json.dumps(x, ensure_ascii=False, indent=indent)` as transformers' `tojson`.
fn tojson(value: JValue, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    // Bounded: the template may come from a downloaded tokenizer_config.json, and an
    // indent of 2^63 would ask for that many spaces.
    let indent: Option<usize> = kwargs
        .get::<Option<usize>>("indent")?
        .map(|n| n.min(MAX_INDENT));
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<JValue> = kwargs.get("separators")?;
    let v = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let mut out = String::new();
    py_json(&v, indent, 0, &mut out);
    Ok(out)
}

fn py_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(m) if !m.is_empty() => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                py_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn strip_chars(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let pred = |c: char| match chars {
        Some(cs) => cs.contains(c),
        None => c.is_whitespace(),
    };
    let mut r = s;
    if left {
        r = r.trim_start_matches(pred);
    }
    if right {
        r = r.trim_end_matches(pred);
    }
    r.to_string()
}

/// Python methods on strings and dicts that HF chat templates call.
fn python_methods(
    _state: &State,
    value: &JValue,
    method: &str,
    args: &[JValue],
) -> std::result::Result<JValue, minijinja::Error> {
    let unknown = || {
        minijinja::Error::new(
            ErrorKind::UnknownMethod,
            format!("{} has no method {method}", value.kind()),
        )
    };
    let arg_str = |i: usize| args.get(i).and_then(|a| a.as_str());
    if let Some(s) = value.as_str() {
        let r: JValue = match method {
            "strip" => strip_chars(s, arg_str(0), true, true).into(),
            "lstrip" => strip_chars(s, arg_str(0), true, false).into(),
            "rstrip" => strip_chars(s, arg_str(0), false, true).into(),
            "upper" => s.to_uppercase().into(),
            "lower" => s.to_lowercase().into(),
            "title" => s
                .split(' ')
                .map(|w| {
                    let mut c = w.chars();
                    match c.next() {
                        Some(f) => {
                            f.to_uppercase().collect::<String>() + &c.as_str().to_lowercase()
                        }
                        None => String::new(),
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
                .into(),
            "capitalize" => {
                let mut c = s.chars();
                match c.next() {
                    Some(f) => {
                        (f.to_uppercase().collect::<String>() + &c.as_str().to_lowercase()).into()
                    }
                    None => String::new().into(),
                }
            }
            "startswith" | "endswith" => {
                let prefixes: Vec<String> = match args.first() {
                    Some(a) if a.as_str().is_some() => vec![a.as_str().unwrap_or("").to_string()],
                    Some(a) => a
                        .try_iter()?
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect(),
                    None => return Err(unknown()),
                };
                let hit = prefixes.iter().any(|p| {
                    if method == "startswith" {
                        s.starts_with(p.as_str())
                    } else {
                        s.ends_with(p.as_str())
                    }
                });
                hit.into()
            }
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(a), Some(b)) => s.replace(a, b).into(),
                _ => return Err(unknown()),
            },
            "split" => {
                let parts: Vec<JValue> = match arg_str(0) {
                    Some(sep) => s.split(sep).map(JValue::from).collect(),
                    None => s.split_whitespace().map(JValue::from).collect(),
                };
                JValue::from(parts)
            }
            "find" => match arg_str(0) {
                Some(a) => (s.find(a).map(|i| i as i64).unwrap_or(-1)).into(),
                None => return Err(unknown()),
            },
            _ => return Err(unknown()),
        };
        return Ok(r);
    }
    if value.kind() == minijinja::value::ValueKind::Map {
        let keys: Vec<JValue> = value.try_iter()?.collect();
        return match method {
            "items" => {
                let mut items = Vec::with_capacity(keys.len());
                for k in keys {
                    let v = value.get_item(&k)?;
                    items.push(JValue::from(vec![k, v]));
                }
                Ok(JValue::from(items))
            }
            "keys" => Ok(JValue::from(keys)),
            "values" => {
                let mut vals = Vec::with_capacity(keys.len());
                for k in keys {
                    vals.push(value.get_item(&k)?);
                }
                Ok(JValue::from(vals))
            }
            "get" => {
                let key = args.first().cloned().ok_or_else(unknown)?;
                let v = value.get_item(&key)?;
                if v.is_undefined() {
                    Ok(args.get(1).cloned().unwrap_or(JValue::from(())))
                } else {
                    Ok(v)
                }
            }
            _ => Err(unknown()),
        };
    }
    Err(unknown())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'].strip() + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_with_strip() {
        let msgs =
            json!([{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"}]);
        let out = render_chat_template(CHATML, &msgs, true, &[]).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_surfaces_message() {
        let t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from user') }}{% endif %}ok";
        let err = render_chat_template(
            t,
            &json!([{"role": "assistant", "content": "x"}]),
            false,
            &[],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("first message must be from user"),
            "{err}"
        );
    }

    #[test]
    fn tojson_is_python_style() {
        let t = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}";
        let out = render_chat_template(t, &json!([{"a": 1, "b": "x<y"}]), false, &[]).unwrap();
        assert_eq!(
            out,
            "{\"a\": 1, \"b\": \"x<y\"}|{\n  \"a\": 1,\n  \"b\": \"x<y\"\n}"
        );
        // An indent no JSON needs (a downloaded template's) is written 64 wide, not asked
        // of the allocator.
        let t = "{{ messages[0] | tojson(indent=9223372036854775807) }}";
        let out = render_chat_template(t, &json!([{"a": 1}]), false, &[]).unwrap();
        assert_eq!(out, format!("{{\n{}\"a\": 1\n}}", " ".repeat(64)));
    }

    #[test]
    fn namespaces_loop_controls_and_dates_render() {
        // Constructs found in Llama 3 / Qwen2.5-style templates: namespace(), loop controls,
        // trim, strftime_now, default().
        let t = "{%- set ns = namespace(sys=none) -%}\
            {%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.sys = m.content | trim -%}{%- break -%}{%- endif -%}{%- endfor -%}\
            [{{ ns.sys | default('none', true) }}]\
            {%- for m in messages -%}{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}<{{ m.role }}:{{ m.content }}>{%- endfor -%}\
            {{ strftime_now('%Y') | length }}";
        let msgs = json!([
            {"role": "system", "content": "  S  "},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}
        ]);
        let out = render_chat_template(t, &msgs, false, &[]).unwrap();
        assert_eq!(out, "[S]<user:u1><assistant:a1>4");
    }

    /// Extra variables reach the template and replace a special token of the same name, as
    /// transformers' keyword arguments do; `tools` and `documents` are none unless given;
    /// the renderer's own variables cannot be replaced.
    #[test]
    fn extra_variables_are_passed_like_transformers_kwargs() {
        let t = "{{ bos_token }}|{{ enable_thinking }}|{{ tools is none }}|{{ documents is none }}";
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let specials = [("bos_token", Some("<s>"))];
        let out = render_chat_template(t, &msgs, false, &specials).unwrap();
        assert_eq!(out, "<s>||True|True");
        let extra: Map<String, Value> = serde_json::from_value(
            json!({"enable_thinking": false, "bos_token": "<b>", "tools": []}),
        )
        .unwrap();
        let out = render_chat_template_with(t, &msgs, false, &specials, &extra).unwrap();
        assert_eq!(out, "<b>|False|False|True");
        for name in RESERVED_TEMPLATE_VARS {
            let extra: Map<String, Value> = serde_json::from_value(json!({ *name: true })).unwrap();
            let err = render_chat_template_with(t, &msgs, false, &specials, &extra).unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn dict_items_and_string_methods() {
        let t = "{% for k, v in messages[0].items() %}{{ k }}={{ v.upper() }};{% endfor %}{{ 'a,b'.split(',') | length }}{{ ' x '.rstrip() }}|{% if 'abc'.startswith('ab') %}yes{% endif %}";
        let out = render_chat_template(t, &json!([{"a": "x", "b": "y"}]), false, &[]).unwrap();
        assert_eq!(out, "a=X;b=Y;2 x|yes");
    }
}
