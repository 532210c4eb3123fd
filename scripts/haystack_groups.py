#!/usr/bin/env python3
# Post-hoc breakdown of `llama2c_headline --haystack-large` output (docs/quality.md, stop 40):
# recommended() / H2O / counted per filler and per length, and the distinct-key reserve at 1/4
# paired against recommended() (sign test). Usage: haystack_groups.py OUTPUT.txt
import re,sys
from math import comb
def st(a,b):
  n=a+b;k=min(a,b);return min(1,2*sum(comb(n,i) for i in range(k+1))/2**n)
L=open(sys.argv[1]).read().splitlines()
idx=[int(x) for x in [l for l in L if l.startswith('counted story indices:')][0].split(':')[1].split()]
rows={}
for l in L:
  m=re.match(r'^(\d+) \| (.*) \| ([01]+)$',l)
  if m: rows[(int(m[1]),m[2])]=m[3]
R='**DecayedAttention::recommended()**'; H='H2O (recent B/4)'; Q='recommended() with the distinct-key reserve, recall 1/4'
for B in (16,32,64,128):
  r,h,q=rows[(B,R)],rows[(B,H)],rows[(B,Q)]
  per=[]
  for f in range(2,10):
    sel=[i for i,s in enumerate(idx) if s//30+2==f]
    per.append(f"f{f}: {sum(r[i]=='1' for i in sel)}/{sum(h[i]=='1' for i in sel)}/{len(sel)}")
  a=sum(1 for x,y in zip(q,r) if x=='1' and y=='0'); b=sum(1 for x,y in zip(q,r) if x=='0' and y=='1')
  lens=[]
  for Lk,Ln in enumerate((200,320,440)):
    sel=[i for i,s in enumerate(idx) if s%3==Lk]
    lens.append(f"{Ln}: {sum(r[i]=='1' for i in sel)}/{sum(h[i]=='1' for i in sel)}/{len(sel)}")
  print(B,'rec/H2O/n per filler:',' '.join(per))
  print(B,'rec/H2O/n per length:',' '.join(lens))
  print(B,f'1/4 reserve vs recommended(): only 1/4 {a}, only recommended {b}, sign p {st(a,b):.3f}')
