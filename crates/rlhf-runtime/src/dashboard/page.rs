//! The dashboard's two pages: the cluster (nodes, actors, jobs) and one job (plots, latest
//! metrics, samples, roles). Both are static and poll JSON; every value goes into the page
//! as text (`textContent`), never as markup, and plots come as SVG images drawn on the head
//! (`plot.rs`), shown through `blob:` URLs so they need the token like the JSON does.
//!
//! The cluster token is typed into the cluster page, or handed over in the address as
//! `#token=...` (a fragment: browsers never send it to the server); it is kept in the tab's
//! sessionStorage and the fragment is removed from the address bar at once.

const STYLE: &str = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}\
#plots{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}figcaption{font-size:90%;color:#444}\
.err{color:#b00}";

const COMMON_JS: &str = r#"'use strict';
if(location.hash.startsWith('#token=')){sessionStorage.setItem('rlhf-token',decodeURIComponent(location.hash.slice(7)));
history.replaceState(null,'',location.pathname+location.search)}
const tok=()=>sessionStorage.getItem('rlhf-token');
const auth=()=>tok()?{'Authorization':'Bearer '+tok()}:{};
const el=(tag,text)=>{const e=document.createElement(tag);if(text!==undefined&&text!==null)e.textContent=String(text);return e};
function table(title,head,rows){const d=el('div');d.append(el('h2',title));const t=el('table');const tr=el('tr');
for(const h of head)tr.append(el('th',h));t.append(tr);
for(const r of rows){const x=el('tr');for(const c of r)x.append(c instanceof Node?c:el('td',c));t.append(x)}d.append(t);return d}
const gib=b=>b?(b/1073741824).toFixed(2)+' GiB':'';
"#;

/// The cluster page (`/`).
pub fn cluster() -> String {
    format!(
        r#"<!doctype html><html><head><meta charset="utf-8"><title>rlhf cluster</title>
<style>{STYLE}</style></head><body><h1>rlhf cluster</h1>
<form id="f">cluster token (kept for this tab only): <input id="t" type="password" autocomplete="off"> <button>show all</button></form>
<div id="s">loading…</div><script>{COMMON_JS}
document.getElementById('f').addEventListener('submit',ev=>{{ev.preventDefault();
sessionStorage.setItem('rlhf-token',document.getElementById('t').value);load()}});
function jobLink(id){{const td=el('td');const a=el('a',id);a.href='/jobs/'+encodeURIComponent(id);td.append(a);return td}}
async function load(){{
const r=await fetch('/api/status',{{headers:auth()}});
if(!r.ok){{document.getElementById('s').replaceChildren(el('p',r.status===401?'wrong cluster token':'status: HTTP '+r.status));return}}
const s=await r.json();
const out=el('div');
out.append(table('Nodes',['node','host','state','resources (used/total)'],s.nodes.map(n=>
[n.node_id,(n.hostname||'')+' '+(n.address||''),n.state+' '+(n.death_reason||''),(n.usage||[]).join(' · ')])));
if(s.actors){{out.append(table('Actors',['actor','role','node','state','memory','reason'],s.actors.map(a=>[a.actor_id,a.role,a.node_id,a.state,gib(a.rss_bytes),a.reason])));
out.append(table('Jobs',['job','config','state','submitted','error'],(s.jobs||[]).map(j=>[jobLink(j.job_id),j.config_name,j.state,new Date(j.submit_ms).toISOString(),j.error])))}}
else{{out.append(el('p',`${{s.counts.actors}} actors, ${{s.counts.jobs}} jobs; enter the cluster token to see them`))}}
document.getElementById('s').replaceChildren(out)}}
load();setInterval(load,2000);</script></body></html>"#
    )
}

/// The page of one job (`/jobs/{id}`).
pub fn job() -> String {
    format!(
        r#"<!doctype html><html><head><meta charset="utf-8"><title>rlhf job</title>
<style>{STYLE}</style></head><body><p><a href="/">cluster</a></p><h1 id="title">job</h1>
<p id="summary">loading…</p><div id="plots"></div><div id="latest"></div><div id="samples"></div><div id="roles"></div>
<script>{COMMON_JS}
const id=decodeURIComponent(location.pathname.split('/').pop());
const base='/api/jobs/'+encodeURIComponent(id);
document.getElementById('title').textContent='job '+id;
document.title='rlhf '+id;
let drawnStep=null;const figs=new Map();
async function plot(p){{
let f=figs.get(p.index);
if(!f){{f={{fig:el('figure'),img:el('img'),cap:el('figcaption')}};f.img.alt=p.title;
f.fig.append(f.img,f.cap);document.getElementById('plots').append(f.fig);figs.set(p.index,f)}}
const r=await fetch(base+'/plot/'+p.index,{{headers:auth()}});
if(!r.ok)return;
const url=URL.createObjectURL(await r.blob());
const old=f.img.src;f.img.src=url;if(old.startsWith('blob:'))URL.revokeObjectURL(old);
f.fig.dataset.points=String(p.points);
f.cap.textContent=`${{p.title}}: ${{p.series.join(', ')}} (${{p.points}} points)`}}
async function load(){{
const r=await fetch(base,{{headers:auth()}});
const summary=document.getElementById('summary');
if(r.status===401){{summary.replaceChildren(el('span','this page needs the cluster token: enter it on the cluster page, or open the address with #token=...'));return}}
if(!r.ok){{summary.textContent='job: HTTP '+r.status+' '+(await r.text());return}}
const j=await r.json();
summary.textContent=`${{j.job.state}} · config ${{j.job.config_name}} · step ${{j.step??'-'}}`+(j.job.error?` · ${{j.job.error}}`:'');
summary.dataset.state=j.job.state;
if(j.step!==drawnStep){{drawnStep=j.step;await Promise.all(j.plots.map(plot))}}
document.getElementById('latest').replaceChildren(table('Latest step',['metric','value'],Object.entries(j.latest).map(([k,v])=>[k,Number(v).toPrecision(6)])));
document.getElementById('samples').replaceChildren(table('Samples'+(j.samples.step!==null?` (step ${{j.samples.step}})`:''),['query','response','score'],
j.samples.rows.map(s=>[s.query,s.response,s.score])));
document.getElementById('roles').replaceChildren(table('Roles',['process','role','node','devices','resources','state','memory (RSS)','reason'],
j.roles.map(a=>[a.name,a.role,a.node_id+(a.host?' ('+a.host+')':''),a.devices.join(','),JSON.stringify(a.resources),a.state,gib(a.rss_bytes),a.reason])))}}
async function tick(){{try{{await load()}}catch(e){{document.getElementById('summary').textContent='cannot reach the head: '+e}}}}
tick();setInterval(tick,3000);</script></body></html>"#
    )
}
