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

/// Reads one pickle: runs its opcodes on a stack until STOP and returns what is on top.
pub(super) fn unpickle(data: &[u8]) -> Result<Value, String> {
    let mut machine = Unpickler {
        data,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    loop {
        let op = machine.take(1)?[0];
        if op == b'.' {
            return machine.pop(); // STOP
        }
        machine.step(op)?;
    }
}

/// The unpickler's state: the bytes, where it reads, its stack and its memo.
struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Item>,
    memo: HashMap<u32, Value>,
}

/// The little-endian `u32` in the first 4 bytes of `b`.
fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

impl<'a> Unpickler<'a> {
    /// Runs opcode `op` (any but STOP): one arm per opcode, each a push or a named step.
    fn step(&mut self, op: u8) -> Result<(), String> {
        match op {
            0x80 => {
                self.take(1)?; // PROTO
            }
            0x95 => {
                self.take(8)?; // FRAME
            }
            b'(' => self.stack.push(Item::Mark),
            b'N' => self.push(Value::None),
            0x88 => self.push(Value::Bool(true)),
            0x89 => self.push(Value::Bool(false)),
            b'J' => {
                let b = self.take(4)?;
                self.push(Value::Int(le_u32(b) as i32 as i64));
            }
            b'K' => {
                let b = self.take(1)?[0];
                self.push(Value::Int(b as i64));
            }
            b'M' => {
                let b = self.take(2)?;
                self.push(Value::Int(u16::from_le_bytes([b[0], b[1]]) as i64));
            }
            0x8a => self.long1()?,
            b'G' => {
                let b = self.take(8)?;
                let v = f64::from_be_bytes(b.try_into().map_err(|_| "float")?);
                self.push(Value::Float(v));
            }
            b'U' | b'C' | b'T' | b'B' | 0x8e => self.bytes(op)?,
            b'X' | 0x8c => self.string(op)?,
            b'c' => self.global()?,
            0x93 => self.stack_global()?,
            b']' => self.push(Value::List(Vec::new())),
            b')' => self.push(Value::Tuple(Vec::new())),
            b'}' => self.push(Value::Dict(Vec::new())),
            b't' => {
                let items = self.pop_mark()?;
                self.push(Value::Tuple(items));
            }
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Value::List(items));
            }
            b'd' => {
                let items = self.pop_mark()?;
                self.push(Value::Dict(pairs(items)?));
            }
            0x85..=0x87 => self.small_tuple((op - 0x84) as usize)?,
            b'a' => {
                let v = self.pop()?;
                self.extend_list(vec![v], "APPEND")?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.extend_list(items, "APPENDS")?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.extend_dict(vec![(k, v)], "SETITEM")?;
            }
            b'u' => {
                let items = pairs(self.pop_mark()?)?;
                self.extend_dict(items, "SETITEMS")?;
            }
            b'R' | 0x81 => self.reduce()?,
            b'b' => self.build()?,
            b'q' | b'r' | 0x94 => self.memoize(op)?,
            b'h' | b'j' => self.recall(op)?,
            b'0' => {
                self.stack.pop().ok_or("POP on an empty stack")?;
            }
            other => {
                return Err(format!(
                    "unsupported pickle opcode 0x{other:02x} at byte {} (not a CIFAR-10 python batch?)",
                    self.pos - 1
                ));
            }
        }
        Ok(())
    }

    /// The next `n` bytes, or an error when fewer are left.
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let pos = self.pos;
        if self.data.len() - pos < n {
            return Err(format!("truncated at byte {pos}: needs {n} more bytes"));
        }
        let s = &self.data[pos..pos + n];
        self.pos += n;
        Ok(s)
    }

    /// Pushes `v` onto the stack.
    fn push(&mut self, v: Value) {
        self.stack.push(Item::Value(v));
    }

    /// The value on top of the stack, taken off it.
    fn pop(&mut self) -> Result<Value, String> {
        match self.stack.pop() {
            Some(Item::Value(v)) => Ok(v),
            Some(Item::Mark) => Err("unexpected mark on the stack".into()),
            None => Err("stack underflow".into()),
        }
    }

    /// The values above the topmost mark, in the order they were pushed; the mark removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let mut items = Vec::new();
        loop {
            match self.stack.pop() {
                Some(Item::Value(v)) => items.push(v),
                Some(Item::Mark) => {
                    items.reverse();
                    return Ok(items);
                }
                None => return Err("no mark on the stack".into()),
            }
        }
    }

    /// LONG1: a little-endian two's-complement integer of up to 8 bytes.
    fn long1(&mut self) -> Result<(), String> {
        let n = self.take(1)?[0] as usize;
        let b = self.take(n)?;
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
        self.push(Value::Int(v));
        Ok(())
    }

    /// Raw bytes behind a 1-, 4- or 8-byte length: python 2 str (CIFAR's own files) and python
    /// 3 bytes alike.
    fn bytes(&mut self, op: u8) -> Result<(), String> {
        let n = match op {
            b'U' | b'C' => self.take(1)?[0] as usize,
            b'T' | b'B' => le_u32(self.take(4)?) as usize,
            _ => {
                let b = self.take(8)?;
                let n = u64::from_le_bytes(b.try_into().map_err(|_| "len")?);
                usize::try_from(n).map_err(|_| "length overflows")?
            }
        };
        let bytes = self.take(n)?.to_vec();
        self.push(Value::Bytes(bytes));
        Ok(())
    }

    /// A UTF-8 string behind a 4-byte (`X`) or 1-byte length.
    fn string(&mut self, op: u8) -> Result<(), String> {
        let n = if op == b'X' {
            le_u32(self.take(4)?) as usize
        } else {
            self.take(1)?[0] as usize
        };
        let s = String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "string is not UTF-8")?;
        self.push(Value::Str(s));
        Ok(())
    }

    /// GLOBAL `module\nname\n`: recorded, never resolved.
    fn global(&mut self) -> Result<(), String> {
        let module = self.global_line()?;
        let name = self.global_line()?;
        self.push(Value::Global(module, name));
        Ok(())
    }

    /// One newline-terminated line of a GLOBAL.
    fn global_line(&mut self) -> Result<String, String> {
        let data = self.data;
        let rest = &data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("unterminated GLOBAL")?;
        self.pos += end + 1;
        String::from_utf8(rest[..end].to_vec()).map_err(|_| "GLOBAL is not UTF-8".into())
    }

    /// STACK_GLOBAL: a GLOBAL whose module and name are the two strings on the stack.
    fn stack_global(&mut self) -> Result<(), String> {
        let name = self.pop()?;
        let module = self.pop()?;
        match (module, name) {
            (Value::Str(m), Value::Str(n)) => self.push(Value::Global(m, n)),
            _ => return Err("STACK_GLOBAL needs two strings".into()),
        }
        Ok(())
    }

    /// TUPLE1 to TUPLE3: the top `n` values as a tuple.
    fn small_tuple(&mut self, n: usize) -> Result<(), String> {
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.pop()?);
        }
        items.reverse();
        self.push(Value::Tuple(items));
        Ok(())
    }

    /// APPEND(S): `items` added to the list on top of the stack.
    fn extend_list(&mut self, items: Vec<Value>, opcode: &str) -> Result<(), String> {
        match self.stack.last_mut() {
            Some(Item::Value(Value::List(l))) => l.extend(items),
            _ => return Err(format!("{opcode} to something that is not a list")),
        }
        Ok(())
    }

    /// SETITEM(S): `items` added to the dict on top of the stack.
    fn extend_dict(&mut self, items: Vec<(Value, Value)>, opcode: &str) -> Result<(), String> {
        match self.stack.last_mut() {
            Some(Item::Value(Value::Dict(d))) => d.extend(items),
            _ => return Err(format!("{opcode} on something that is not a dict")),
        }
        Ok(())
    }

    /// REDUCE / NEWOBJ: the call recorded, never made.
    fn reduce(&mut self) -> Result<(), String> {
        let args = self.pop()?;
        let callable = self.pop()?;
        self.push(Value::Object {
            callable: Box::new(callable),
            args: Box::new(args),
            state: None,
        });
        Ok(())
    }

    /// BUILD: the state on top given to the object under it.
    fn build(&mut self) -> Result<(), String> {
        let state = self.pop()?;
        match self.stack.last_mut() {
            Some(Item::Value(Value::Object { state: slot, .. })) => *slot = Some(Box::new(state)),
            _ => return Err("BUILD on something that is not an object".into()),
        }
        Ok(())
    }

    /// (BIN|LONG_BIN)PUT and MEMOIZE: the value on top stored under a key (the memo's size for
    /// MEMOIZE).
    fn memoize(&mut self, op: u8) -> Result<(), String> {
        let key = match op {
            b'q' => self.take(1)?[0] as u32,
            b'r' => le_u32(self.take(4)?),
            _ => self.memo.len() as u32,
        };
        match self.stack.last() {
            Some(Item::Value(v)) => {
                self.memo.insert(key, v.clone());
            }
            _ => return Err("memoizing an empty stack".into()),
        }
        Ok(())
    }

    /// BINGET / LONG_BINGET: a stored value pushed again.
    fn recall(&mut self, op: u8) -> Result<(), String> {
        let key = if op == b'h' {
            self.take(1)?[0] as u32
        } else {
            le_u32(self.take(4)?)
        };
        let v = self
            .memo
            .get(&key)
            .ok_or(format!("memo key {key} was never stored"))?
            .clone();
        self.push(v);
        Ok(())
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
