#!/usr/bin/env node
// The oracle: encodes nemoh's tokenizer test corpus with Hugging Face tokenizers (npm
// tokenizers@0.23.2, the Rust core of Python tokenizers 0.23) and writes what it answers:
//
//   tests/fixtures/tokenizer/<name>.expected.json for <name> in tekken, gpt2, edge:
//     "encode": [{"text" | "hex", "pieces"?, "ids", "decoded"?}]  pieces = the byte lengths of the
//               pre-tokenizer's split of the whole text (its regex alone, no added tokens);
//               ids = encode(text) with the post-processor's special tokens; "decoded" =
//               decode(ids, skip_special_tokens=false) where that is not the text itself. A
//               "hex" case is input that is not UTF-8: HF takes strings, so its ids are those of
//               the text a lossy UTF-8 decoding gives (Node's and Rust's replace alike)
//     "decode": [{"ids", "text"}]  decode(ids) of byte-token and random id sequences, many of
//               them invalid UTF-8 (HF shows those as U+FFFD)
//
// Cases: every line of tests/fixtures/tokenizer/corpus.txt, then generated ones (very long
// words, every whitespace code point in context, seeded random strings over one character of
// each class the splits tell apart). Deterministic: rerunning gives the same files.
//
//   cd tools && npm ci && node make_tokenizers.js && node tokenizer_oracle.js
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');
const { B2C } = require('./tekken');

const FIX = path.join(__dirname, '..', 'tests', 'fixtures', 'tokenizer');

// The corpus escapes: \n \r \t \\ \xHH \uHHHH \u{H...}.
function unescape(line) {
  return line.replace(/\\(n|r|t|\\|x[0-9A-Fa-f]{2}|u\{[0-9A-Fa-f]+\}|u[0-9A-Fa-f]{4})/g, (_, e) => {
    if (e === 'n') return '\n';
    if (e === 'r') return '\r';
    if (e === 't') return '\t';
    if (e === '\\') return '\\';
    if (e[0] === 'x') return String.fromCodePoint(parseInt(e.slice(1), 16));
    return String.fromCodePoint(parseInt(e.replace(/[u{}]/g, ''), 16));
  });
}

// mulberry32: a small seeded PRNG, so the generated cases never change between runs.
function rng(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WHITESPACE = [0x9, 0xa, 0xb, 0xc, 0xd, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003,
  0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000];
const NEAR_MISSES = [0x1c, 0x1d, 0x1e, 0x1f, 0x180e, 0x200b, 0x200c, 0x200d, 0x2060, 0xfeff, 0x0];

// One or more characters of each class the two splits tell apart, and strings the added-token
// matcher must see (or must not).
const ATOMS = [' ', ' ', ' ', '\t', '\n', '\r', '\r\n', '\u000b', '\u00a0', '\u3000', '\u2028', '\u0085',
  'a', 'z', 's', 't', 'e', 'r', 'v', 'l', 'm', 'd', 'ß', 'é', 'A', 'Z', 'É', 'Σ', 'ǅ', 'ᾈ', 'ʰ', '々',
  '中', '한', 'ا', 'क', '\u0301', '\u0903', '\u20dd', '0', '7', '٣', 'Ⅷ', '½', '.', ',', '/', '//', "'",
  '!', '-', '_', '"', '<', '>', '|', '😀', '👍🏽', '\u200d', '\u200b', '\ufeff', '\u001c', '\u001f',
  '<s>', '</s>', '<unk>', '<SPECIAL_7>', '<SPECIAL_', '<|endoftext|>', '<|endoftext', 'the', 'The', 'THE',
  '<bos>', 'text|>', 'ab', 'bcd', '\u0120hi'];

// Input bytes that are not UTF-8: stray continuation bytes, truncated and overlong sequences,
// surrogates, bytes that never occur.
const INVALID_UTF8 = ['ff', '80', '41ff42', 'e282', 'e28241', 'c0af', 'eda080', 'f4908080', 'f09f98',
  '20f09f9820', 'c3', '68c3a9c3', '3c73e23e', '2780737472', 'e0808061', 'fe20ff', 'cf80cf'];

function generated() {
  const cases = [''];
  for (const cp of [...WHITESPACE, ...NEAR_MISSES]) {
    const c = String.fromCodePoint(cp);
    cases.push(`x${c}y ${c}${c}z !${c}\n ${c}\r\n${c}a ${c}${c}`);
  }
  const r = rng(20240718);
  const pick = (s) => s[Math.floor(r() * s.length)];
  const randomFrom = (alphabet, n) => Array.from({ length: n }, () => pick(alphabet)).join('');
  cases.push(
    'supercalifragilisticexpialidocious'.repeat(600),
    randomFrom('abcdefghijklmnopqrstuvwxyz', 20000),
    'a'.repeat(10001),
    ' '.repeat(5000) + 'x',
    '\n'.repeat(3000),
    ' \t\r\n'.repeat(1000) + 'y',
    '!'.repeat(5000),
    '9'.repeat(3000),
    '中'.repeat(3000),
    randomFrom([...'的一是不了人我在有他这为之大来以个中上们한국어텍스트가나다'], 3000),
    '😀'.repeat(2000),
    'Ab'.repeat(5000),
    'ABC'.repeat(4000),
    '\u0301'.repeat(3000),
    'é'.repeat(3000),
    'e\u0301'.repeat(3000),
  );
  for (let i = 0; i < 2000; i++) cases.push(Array.from({ length: 1 + Math.floor(r() * 20) }, () => pick(ATOMS)).join(''));
  return cases;
}

// Id sequences for decode: each byte token alone, hand-picked invalid UTF-8, random byte-token
// sequences biased towards lead and continuation bytes, and random ids from the whole vocab.
function decodeSequences(tok, vocabSize) {
  const byteId = B2C.map((c) => tok.tokenToId(c));
  const seqs = byteId.map((id) => [id]);
  const hand = [[0xe2, 0x82, 0xac], [0xe2, 0x82], [0xe2, 0x82, 0x41], [0xe2], [0xe2, 0x41], [0xf0, 0x9f, 0x98, 0x80],
    [0xf0, 0x9f, 0x98], [0xf0, 0x80, 0x80, 0x80], [0xc0, 0xaf], [0xc1, 0xbf], [0xed, 0xa0, 0x80], [0xed, 0x9f, 0xbf],
    [0xf4, 0x8f, 0xbf, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf5, 0x80], [0xff, 0xfe], [0x80, 0x80, 0x41],
    [0xe0, 0x80, 0x80], [0xe0, 0xa0, 0x80], [0xc3], [0xc3, 0xc3, 0xa9], [0x41, 0xf0, 0x9f, 0x41, 0x98, 0x80]];
  for (const s of hand) seqs.push(s.map((b) => byteId[b]));
  const r = rng(7);
  const bytes = [0x41, 0x20, 0x0a, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc2, 0xc3, 0xdf, 0xe0, 0xe2, 0xed,
    0xef, 0xf0, 0xf4, 0xf5, 0xff];
  for (let i = 0; i < 600; i++)
    seqs.push(Array.from({ length: 1 + Math.floor(r() * 12) }, () => byteId[bytes[Math.floor(r() * bytes.length)]]));
  for (let i = 0; i < 300; i++)
    seqs.push(Array.from({ length: 1 + Math.floor(r() * 12) }, () => Math.floor(r() * vocabSize)));
  return seqs;
}

async function run(name) {
  const tok = Tokenizer.fromFile(path.join(FIX, name, 'tokenizer.json'));
  const lines = fs.readFileSync(path.join(FIX, 'corpus.txt'), 'utf8').split('\n');
  const texts = lines.filter((l) => l && !l.startsWith('#')).map(unescape).concat(generated());
  const pre = tok.getPreTokenizer();
  const out = [];
  for (const text of texts) {
    // byte-level pieces: one character per byte
    const pieces = pre.preTokenizeString(text).map(([p]) => [...p].length);
    if (pieces.reduce((a, b) => a + b, 0) !== Buffer.byteLength(text)) throw new Error('pieces do not cover the text');
    const ids = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    const decoded = await tok.decode(ids, false);
    out.push(JSON.stringify(decoded === text ? { text, pieces, ids } : { text, pieces, ids, decoded }));
  }
  for (const hex of INVALID_UTF8) {
    const ids = (await tok.encode(Buffer.from(hex, 'hex').toString('utf8'))).getIds();
    out.push(JSON.stringify({ hex, ids, decoded: await tok.decode(ids, false) }));
  }
  const dec = [];
  for (const ids of decodeSequences(tok, tok.getVocabSize(true)))
    dec.push(JSON.stringify({ ids, text: await tok.decode(ids, false) }));
  const file = path.join(FIX, `${name}.expected.json`);
  fs.writeFileSync(file, `{"tokenizer": "${name}", "oracle": "npm tokenizers@0.23.2",\n"encode": [\n` +
    out.join(',\n') + '\n],\n"decode": [\n' + dec.join(',\n') + '\n]}\n');
  console.error(`${file}: ${out.length} encode cases, ${dec.length} decode cases`);
}

(async () => { await run('tekken'); await run('gpt2'); await run('edge'); })();
