#!/usr/bin/env node
// Generates nemoh_unicode.h, the code point classes nemoh's pre-tokenizer splits need, then checks
// every code point against Hugging Face tokenizers itself (its Oniguruma regex engine).
//
//   cd tools && npm ci && node gen_unicode.js        (writes ../nemoh_unicode.h)
//
// Source: the Unicode Character Database of UNICODE_VERSION below, as npm's @unicode/unicode-*
// packages ship it. The version is the one of the Oniguruma inside tokenizers@0.23.2 (6.9.10,
// Unicode 16.0), not Node's own (process.versions.unicode), so that a character added later
// is classed as HF classes it.
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const UNICODE_VERSION = '16.0.0';
const OUT = path.join(__dirname, '..', 'nemoh_unicode.h');

// The classes, in the order of the C enum. A code point has at most one of them.
const CLASSES = [
  ['UC_OTHER', 'none of the below'],
  ['UC_UPPER', 'Lu, Lt: in [\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}] only'],
  ['UC_LOWER', 'Ll: in [\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}] only'],
  ['UC_LETTER', 'Lm, Lo: letters in both case classes'],
  ['UC_MARK', 'M (Mn, Mc, Me): in both case classes, but not \\p{L}'],
  ['UC_NUMBER', 'N (Nd, Nl, No)'],
  ['UC_SPACE', '\\s, which Oniguruma takes as Unicode White_Space'],
];

async function load(prop) {
  const m = await import(`@unicode/unicode-${UNICODE_VERSION}/${prop}/code-points.mjs`);
  return m.default;
}

// Class of every code point from the UCD.
async function classify() {
  const cls = new Uint8Array(0x110000);
  const sets = [
    ['General_Category/Uppercase_Letter', 1], ['General_Category/Titlecase_Letter', 1],
    ['General_Category/Lowercase_Letter', 2],
    ['General_Category/Modifier_Letter', 3], ['General_Category/Other_Letter', 3],
    ['General_Category/Mark', 4], ['General_Category/Number', 5], ['Binary_Property/White_Space', 6],
  ];
  for (const [prop, c] of sets)
    for (const cp of await load(prop)) {
      if (cls[cp] && cls[cp] !== c) throw new Error(`U+${cp.toString(16)} is in two classes`);
      cls[cp] = c;
    }
  return cls;
}

// The code points HF tokenizers' regex engine matches with `re`, by pre-tokenizing every code
// point (surrogates aside) with Split(re, Isolated): a matching code point comes back as a piece
// of its own between two U+0001 separators, which no tested class contains.
function oracleSet(re) {
  const tj = {
    version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer: null,
    pre_tokenizer: { type: 'Split', pattern: { Regex: re }, behavior: 'Isolated', invert: false },
    post_processor: null, decoder: null,
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: false,
      vocab: {}, merges: [] },
  };
  const pre = Tokenizer.fromString(JSON.stringify(tj)).getPreTokenizer();
  const hit = new Uint8Array(0x110000);
  for (let base = 0; base < 0x110000; base += 0x10000) {
    const parts = ['\u0001'];
    for (let cp = base; cp < base + 0x10000; cp++)
      if (cp < 0xd800 || cp > 0xdfff) parts.push(String.fromCodePoint(cp), '\u0001');
    for (const [piece] of pre.preTokenizeString(parts.join(''))) {
      const cps = [...piece];
      if (cps.length === 1 && cps[0] !== '\u0001') hit[cps[0].codePointAt(0)] = 1;
    }
  }
  return hit;
}

function check(cls) {
  // Each regex class the two splits use, and the table classes that make it up.
  const probes = [
    ['[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]', [1, 3, 4]],
    ['[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]', [2, 3, 4]],
    ['\\p{L}', [1, 2, 3]],
    ['\\p{N}', [5]],
    ['\\s', [6]],
    ['\\p{M}', [4]],
    ['[\\p{Lu}\\p{Lt}]', [1]],
  ];
  let bad = 0;
  for (const [re, want] of probes) {
    const hit = oracleSet(re);
    let n = 0;
    for (let cp = 0; cp < 0x110000; cp++) {
      if (cp >= 0xd800 && cp <= 0xdfff) continue;
      const mine = want.includes(cls[cp]) ? 1 : 0;
      if (mine !== hit[cp]) {
        if (n++ < 10) console.error(`${re}: U+${cp.toString(16).toUpperCase()} table ${mine} HF ${hit[cp]}`);
        bad++;
      }
    }
    console.error(`${re}: ${n} disagreements with HF tokenizers`);
  }
  return bad;
}

async function main() {
  const cls = await classify();
  const ranges = [];
  for (let cp = 0; cp < 0x110000; cp++) {
    if (!cls[cp]) continue;
    const last = ranges[ranges.length - 1];
    if (last && last[1] === cp - 1 && last[2] === cls[cp]) last[1] = cp;
    else ranges.push([cp, cp, cls[cp]]);
  }
  if (check(cls)) { console.error('table disagrees with HF tokenizers; not written'); process.exit(1); }
  const hex = (v) => '0x' + v.toString(16).toUpperCase().padStart(4, '0');
  const lines = [];
  for (let i = 0; i < ranges.length; i += 3)
    lines.push('    ' + ranges.slice(i, i + 3).map(([a, b, c]) => `{${hex(a)}, ${hex(b)}, ${CLASSES[c][0]}},`).join(' '));
  const h = `/* nemoh_unicode.h: GENERATED by tools/gen_unicode.js from Unicode ${UNICODE_VERSION} (npm
 * @unicode/unicode-${UNICODE_VERSION}), the Unicode version of the Oniguruma regex engine inside
 * Hugging Face tokenizers 0.23; checked there, code point by code point, against tokenizers 0.23.2.
 * Do not edit: regenerate with \`cd tools && npm ci && node gen_unicode.js\`.
 *
 * The classes of code points the pre-tokenizer splits tell apart, as sorted ranges; code points
 * in no range are UC_OTHER. */
enum {
${CLASSES.map(([n, d], i) => `    ${n} = ${i},${' '.repeat(Math.max(1, 12 - n.length))}/* ${d} */`).join('\n')}
};

/* Code points lo..hi are of class cls; sorted, disjoint. */
static const struct { unsigned lo, hi, cls; } uc_ranges[${ranges.length}] = {
${lines.join('\n')}
};
`;
  fs.writeFileSync(OUT, h);
  console.error(`wrote ${OUT}: ${ranges.length} ranges`);
}
main();
