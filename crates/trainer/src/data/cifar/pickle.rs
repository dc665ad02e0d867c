//! Just enough of Python's unpickler to read CIFAR-10's python batches (protocol 2 pickles of a
//! dict holding a numpy array and a list of labels), written for hostile input: every opcode is
//! checked, nothing is executed, and lengths are bounded by the bytes actually present.

use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Bytes(Vec<u8>),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `module.name`, as GLOBAL names it; never resolved.
    Global(String, String),
    /// `callable(*args)` with the state BUILD gave it, never executed.
    Object {
        callable: Box<Value>,
        args: Box<Value>,
        state: Option<Box<Value>>,
    },
}

impl Value {
    /// Looks a key up in a dict whose keys are bytes or str (python 2 and 3 pickles differ).
    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        let Value::Dict(items) = self else {
            return None;
        };
        items.iter().find_map(|(k, v)| match k {
            Value::Str(s) if s == key => Some(v),
            Value::Bytes(b) if b == key.as_bytes() => Some(v),
            _ => None,
        })
    }
}

enum Item {
    Mark,
    Value(Value),
}

pub(super) fn unpickle(data: &[u8]) -> Result<Value, String> {
    let mut stack: Vec<Item> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    let mut pos = 0usize;
    macro_rules! take {
        ($n:expr) => {{
            let n: usize = $n;
            if data.len() - pos < n {
                return Err(format!("truncated at byte {pos}: needs {n} more bytes"));
            }
            let s = &data[pos..pos + n];
            pos += n;
            s
        }};
    }
    let le_u32 = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let pop = |stack: &mut Vec<Item>| -> Result<Value, String> {
        match stack.pop() {
            Some(Item::Value(v)) => Ok(v),
            Some(Item::Mark) => Err("unexpected mark on the stack".into()),
            None => Err("stack underflow".into()),
        }
    };
    let pop_mark = |stack: &mut Vec<Item>| -> Result<Vec<Value>, String> {
        let mut items = Vec::new();
        loop {
            match stack.pop() {
                Some(Item::Value(v)) => items.push(v),
                Some(Item::Mark) => {
                    items.reverse();
                    return Ok(items);
                }
                None => return Err("no mark on the stack".into()),
            }
        }
    };
    loop {
        let op = take!(1)[0];
        match op {
            0x80 => {
                take!(1); // PROTO
            }
            0x95 => {
                take!(8); // FRAME
            }
            b'.' => return pop(&mut stack), // STOP
            b'(' => stack.push(Item::Mark),
            b'N' => stack.push(Item::Value(Value::None)),
            0x88 => stack.push(Item::Value(Value::Bool(true))),
            0x89 => stack.push(Item::Value(Value::Bool(false))),
            b'J' => {
                let b = take!(4);
                stack.push(Item::Value(Value::Int(le_u32(b) as i32 as i64)));
            }
            b'K' => {
                let b = take!(1)[0];
                stack.push(Item::Value(Value::Int(b as i64)));
            }
            b'M' => {
                let b = take!(2);
                stack.push(Item::Value(Value::Int(
                    u16::from_le_bytes([b[0], b[1]]) as i64
                )));
            }
            0x8a => {
                // LONG1
                let n = take!(1)[0] as usize;
                let b = take!(n);
                if n > 8 {
                    return Err(format!("integer of {n} bytes is too large"));
                }
                let mut v: i64 = 0;
                for (i, byte) in b.iter().enumerate() {
                    v |= (*byte as i64) << (8 * i);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(Item::Value(Value::Int(v)));
            }
            b'G' => {
                let b = take!(8);
                let v = f64::from_be_bytes(b.try_into().map_err(|_| "float")?);
                stack.push(Item::Value(Value::Float(v)));
            }
            // Python 2 str (CIFAR's own files) and python 3 bytes: raw bytes either way.
            b'U' | b'C' => {
                let n = take!(1)[0] as usize;
                stack.push(Item::Value(Value::Bytes(take!(n).to_vec())));
            }
            b'T' | b'B' => {
                let n = le_u32(take!(4)) as usize;
                stack.push(Item::Value(Value::Bytes(take!(n).to_vec())));
            }
            0x8e => {
                let b = take!(8);
                let n = u64::from_le_bytes(b.try_into().map_err(|_| "len")?);
                let n = usize::try_from(n).map_err(|_| "length overflows")?;
                stack.push(Item::Value(Value::Bytes(take!(n).to_vec())));
            }
            b'X' | 0x8c => {
                let n = if op == b'X' {
                    le_u32(take!(4)) as usize
                } else {
                    take!(1)[0] as usize
                };
                let s = String::from_utf8(take!(n).to_vec()).map_err(|_| "string is not UTF-8")?;
                stack.push(Item::Value(Value::Str(s)));
            }
            b'c' => {
                // GLOBAL "module\nname\n"
                let mut line = || -> Result<String, String> {
                    let rest = &data[pos..];
                    let end = rest
                        .iter()
                        .position(|&b| b == b'\n')
                        .ok_or("unterminated GLOBAL")?;
                    pos += end + 1;
                    String::from_utf8(rest[..end].to_vec())
                        .map_err(|_| "GLOBAL is not UTF-8".into())
                };
                let module = line()?;
                let name = line()?;
                stack.push(Item::Value(Value::Global(module, name)));
            }
            0x93 => {
                // STACK_GLOBAL
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => stack.push(Item::Value(Value::Global(m, n))),
                    _ => return Err("STACK_GLOBAL needs two strings".into()),
                }
            }
            b']' => stack.push(Item::Value(Value::List(Vec::new()))),
            b')' => stack.push(Item::Value(Value::Tuple(Vec::new()))),
            b'}' => stack.push(Item::Value(Value::Dict(Vec::new()))),
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Item::Value(Value::Tuple(items)));
            }
            b'l' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Item::Value(Value::List(items)));
            }
            b'd' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Item::Value(Value::Dict(pairs(items)?)));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack)?);
                }
                items.reverse();
                stack.push(Item::Value(Value::Tuple(items)));
            }
            b'a' => {
                let v = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::List(l))) => l.push(v),
                    _ => return Err("APPEND to something that is not a list".into()),
                }
            }
            b'e' => {
                let items = pop_mark(&mut stack)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::List(l))) => l.extend(items),
                    _ => return Err("APPENDS to something that is not a list".into()),
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::Dict(d))) => d.push((k, v)),
                    _ => return Err("SETITEM on something that is not a dict".into()),
                }
            }
            b'u' => {
                let items = pairs(pop_mark(&mut stack)?)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::Dict(d))) => d.extend(items),
                    _ => return Err("SETITEMS on something that is not a dict".into()),
                }
            }
            b'R' | 0x81 => {
                // REDUCE / NEWOBJ: recorded, never called.
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                stack.push(Item::Value(Value::Object {
                    callable: Box::new(callable),
                    args: Box::new(args),
                    state: None,
                }));
            }
            b'b' => {
                let state = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::Object { state: slot, .. })) => {
                        *slot = Some(Box::new(state))
                    }
                    _ => return Err("BUILD on something that is not an object".into()),
                }
            }
            b'q' | b'r' | 0x94 => {
                let key = match op {
                    b'q' => take!(1)[0] as u32,
                    b'r' => le_u32(take!(4)),
                    _ => memo.len() as u32,
                };
                match stack.last() {
                    Some(Item::Value(v)) => {
                        memo.insert(key, v.clone());
                    }
                    _ => return Err("memoizing an empty stack".into()),
                }
            }
            b'h' | b'j' => {
                let key = if op == b'h' {
                    take!(1)[0] as u32
                } else {
                    le_u32(take!(4))
                };
                let v = memo
                    .get(&key)
                    .ok_or(format!("memo key {key} was never stored"))?;
                stack.push(Item::Value(v.clone()));
            }
            b'0' => {
                stack.pop().ok_or("POP on an empty stack")?;
            }
            other => {
                return Err(format!(
                    "unsupported pickle opcode 0x{other:02x} at byte {} (not a CIFAR-10 python batch?)",
                    pos - 1
                ));
            }
        }
    }
}

fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("odd number of items for a dict".into());
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// The raw bytes of a numpy uint8 array pickled by numpy (`_reconstruct` + BUILD state
/// `(version, shape, dtype, fortran, data)`), with its shape.
pub(super) fn numpy_u8(v: &Value) -> Result<(Vec<usize>, &[u8]), String> {
    let Value::Object {
        callable,
        state: Some(state),
        ..
    } = v
    else {
        return Err("'data' is not a pickled numpy array".into());
    };
    if !matches!(&**callable, Value::Global(_, n) if n == "_reconstruct") {
        return Err("'data' is not a pickled numpy array".into());
    }
    let Value::Tuple(fields) = &**state else {
        return Err("numpy array state is not a tuple".into());
    };
    let [_, Value::Tuple(shape), dtype, Value::Bool(fortran), raw] = fields.as_slice() else {
        return Err("numpy array state does not have 5 fields".into());
    };
    if *fortran {
        return Err("numpy array is in Fortran order".into());
    }
    let is_u8 = match dtype {
        Value::Object { args, .. } => {
            matches!(&**args, Value::Tuple(a) if matches!(a.first(), Some(Value::Str(s)) if s == "u1") || matches!(a.first(), Some(Value::Bytes(b)) if b == b"u1"))
        }
        _ => false,
    };
    if !is_u8 {
        return Err("numpy array is not of dtype uint8".into());
    }
    let shape = shape
        .iter()
        .map(|d| match d {
            Value::Int(n) if *n >= 0 => Ok(*n as usize),
            _ => Err("numpy shape is not a tuple of non-negative integers".to_string()),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let raw = match raw {
        Value::Bytes(b) => b.as_slice(),
        _ => return Err("numpy array data is not bytes".into()),
    };
    Ok((shape, raw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn random_bytes_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = unpickle(&bytes);
        }
    }

    #[test]
    fn reads_a_python3_dict() {
        // pickle.dumps({'labels': [1, 2], b'x': b'ab'}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x06\x00\x00\x00labelsq\x01]q\x02(K\x01K\x02eU\x01xq\x03U\x02abq\x04u.";
        let v = unpickle(data).unwrap();
        assert_eq!(
            v.get("labels"),
            Some(&Value::List(vec![Value::Int(1), Value::Int(2)]))
        );
        assert_eq!(v.get("x"), Some(&Value::Bytes(b"ab".to_vec())));
    }
}
