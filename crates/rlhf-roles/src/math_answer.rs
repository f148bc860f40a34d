//! The `math` rule reward's answer checking (RL with verifiable rewards): the final answer of
//! a response (the last `\boxed{...}`, else the last number in it) against the row's
//! `ground_truth`, equal as numbers (integers, decimals, simple fractions `a/b` or
//! `\frac{a}{b}`, thousands separators, a trailing period) or, when either side is no
//! number, as text once spaces and `$` are dropped. A response without an answer scores 0.

/// The final answer of `text`: the content of its last `\boxed{...}` (braces balanced), else
/// its last number; `None` when it has neither.
pub fn extract_answer(text: &str) -> Option<String> {
    if let Some(b) = last_boxed(text) {
        return Some(b);
    }
    last_number(text)
}

/// The content of the last `\boxed{...}` (or `\fbox{...}`) with balanced braces.
fn last_boxed(text: &str) -> Option<String> {
    let start = ["\\boxed{", "\\fbox{"]
        .iter()
        .filter_map(|tag| text.rfind(tag).map(|i| i + tag.len()))
        .max()?;
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].trim().to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// The last number of `text`: an optional minus, digits with optional thousands commas, an
/// optional decimal part, an optional `/digits` denominator.
fn last_number(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut found = None;
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let mut start = i;
            if start > 0 && b[start - 1] == b'-' {
                start -= 1;
            }
            let mut j = i;
            while j < b.len()
                && (b[j].is_ascii_digit()
                    || (matches!(b[j], b',' | b'.' | b'/')
                        && j + 1 < b.len()
                        && b[j + 1].is_ascii_digit()))
            {
                j += 1;
            }
            found = Some(text[start..j].to_string());
            i = j;
        } else {
            i += 1;
        }
    }
    found
}

/// `s` as a number: integers, decimals, `a/b`, `\frac{a}{b}` / `\dfrac{a}{b}`, with
/// thousands commas, `$`, spaces and a trailing period ignored.
pub fn parse_number(s: &str) -> Option<f64> {
    let t: String = s
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '$' && *c != ',')
        .collect();
    let t = t.trim_end_matches('.');
    let t = t.strip_prefix("\\left(").unwrap_or(t);
    for frac in ["\\dfrac{", "\\tfrac{", "\\frac{"] {
        if let Some(rest) = t.strip_prefix(frac) {
            let (num, rest) = rest.split_once("}{")?;
            let den = rest.strip_suffix('}')?;
            return ratio(parse_number(num)?, parse_number(den)?);
        }
        if let Some(rest) = t.strip_prefix(&format!("-{frac}")) {
            return parse_number(&format!("{frac}{rest}")).map(|x| -x);
        }
    }
    if let Some((num, den)) = t.split_once('/') {
        return ratio(num.parse::<f64>().ok()?, den.parse::<f64>().ok()?);
    }
    t.parse::<f64>().ok().filter(|x| x.is_finite())
}

fn ratio(num: f64, den: f64) -> Option<f64> {
    (den != 0.0).then(|| num / den).filter(|x| x.is_finite())
}

/// Whether `response`'s final answer equals `truth`; `None` when the response has no answer
/// at all (it then scores 0, and is counted apart).
pub fn is_correct(response: &str, truth: &str) -> Option<bool> {
    let got = extract_answer(response)?;
    let want = last_boxed(truth).unwrap_or_else(|| truth.trim().to_string());
    Some(match (parse_number(&got), parse_number(&want)) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
        _ => {
            let norm = |s: &str| -> String {
                s.chars()
                    .filter(|c| !c.is_whitespace() && *c != '$')
                    .collect::<String>()
                    .trim_end_matches('.')
                    .to_string()
            };
            norm(&got) == norm(&want)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_found_and_compared_as_numbers_or_text() {
        let cases: &[(&str, &str, Option<bool>)] = &[
            ("So the answer is \\boxed{42}.", "42", Some(true)),
            ("First 3, then \\boxed{\\frac{1}{2}}", "0.5", Some(true)),
            ("\\boxed{\\dfrac{3}{4}} and more text 7", "3/4", Some(true)),
            ("It costs $1,234.50 in all.", "1234.5", Some(true)),
            ("The result: -7.", "-7", Some(true)),
            ("I get 2/6", "1/3", Some(true)),
            ("We find 41 apples", "42", Some(false)),
            ("nested \\boxed{x^{2}+1}", "x^{2} + 1", Some(true)),
            ("\\boxed{x^{2}+1}", "x^2+2", Some(false)),
            ("no answer here", "3", None),
            ("unbalanced \\boxed{12", "12", Some(true)),
            ("two boxes \\boxed{1} then \\boxed{2}", "2", Some(true)),
            ("divide by zero 1/0", "1", Some(false)),
            ("answer 12", "\\boxed{12}", Some(true)),
        ];
        for (resp, truth, want) in cases {
            assert_eq!(is_correct(resp, truth), *want, "{resp:?} vs {truth:?}");
        }
        assert_eq!(parse_number("1e999"), None);
        assert_eq!(parse_number("-\\frac{1}{4}"), Some(-0.25));
    }
}
