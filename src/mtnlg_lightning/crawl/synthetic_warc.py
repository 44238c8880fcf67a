"""A crawl made offline, with its truth written beside it: the test bed of `mtnlg-extract` and `mtnlg-quality`.

English pages carry real prose that every Python install ships (paragraphs of the standard library's docstrings,
as the demo corpus uses), wrapped in the boilerplate of a real site: a cookie banner, navigation, breadcrumbs, a
byline, share buttons, a sidebar of related links and a newsletter box, a footer. Pages in seven other languages
carry short paragraphs written for this purpose, in their own language's boilerplate. Beside them: junk pages
(keyword spam, link farms, repeated lines, lorem ipsum, price lists), non-HTML payloads, redirects and missing
pages, and broken records (a garbled HTTP header, a body that claims gzip and is not, bytes that are not the
declared charset, an empty body, a corrupt gzip member). The truth file lists, per record, what it is and, for a
page, its language, its body paragraphs and its boilerplate text, so extraction can be scored word by word.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import sysconfig
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# --- real English prose: paragraphs of the standard library's docstrings -----------------------------------------

_DOCSTRING = re.compile(r'^[ \t]*[rRuU]?"""(.*?)"""', re.DOTALL | re.MULTILINE)


def _prose_paragraphs(docstring: str, min_words: int, min_chars: int) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", docstring):
        lines = [line.strip() for line in para.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "-", "*", "..", ":", "#", "|", "+")) for line in lines):
            continue
        if any(line.endswith("::") for line in lines):  # the paragraph introduces a code block
            continue
        words = " ".join(lines).split()
        if (
            len(words) < min_words
            or len(" ".join(words)) < min_chars
            or sum(w.strip(".,;:()'\"`").isalpha() for w in words) < 0.8 * len(words)
        ):
            continue
        out.append(" ".join(words))
    return out


def english_paragraphs(count: int, min_words: int = 35, min_chars: int = 200) -> list[tuple[str, str]]:
    """The first ``count`` prose paragraphs (module name, paragraph) of the standard library's docstrings, in
    file order; paragraphs repeated across modules are taken once. Article-length paragraphs by default: jusText
    keeps a page only when one of its paragraphs reaches 200 characters (its length_high)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for m in _DOCSTRING.finditer(source):
            for para in _prose_paragraphs(m.group(1), min_words, min_chars):
                if para not in seen:
                    seen.add(para)
                    out.append((path.stem, para))
                    if len(out) >= count:
                        return out
    return out


# --- other languages: paragraphs written for this test bed ------------------------------------------------------

FOREIGN_PARAGRAPHS: dict[str, list[str]] = {
    "de": [
        "Die Stadtbibliothek bleibt in den Sommerferien an allen Wochentagen geöffnet. Wer ein Buch länger behalten "
        "möchte, kann die Leihfrist online oder direkt an der Theke verlängern. Für Kinder gibt es jeden Mittwoch "
        "eine Vorlesestunde, und die Jugendabteilung hat viele neue Romane und Sachbücher bekommen.",
        "Nach dem starken Regen der letzten Wochen ist der Wasserstand des Flusses deutlich gestiegen. Die Behörden "
        "raten den Anwohnern, ihre Keller zu kontrollieren und wichtige Dokumente nicht im Erdgeschoss aufzubewahren. "
        "Die Feuerwehr ist mit zusätzlichen Pumpen im Einsatz und informiert laufend über die Lage.",
        "Das Rezept ist einfach und gelingt auch Anfängern. Zuerst werden die Kartoffeln geschält und in dünne "
        "Scheiben geschnitten. Dann brät man die Zwiebeln in etwas Butter an, gibt die Kartoffeln dazu und lässt "
        "alles bei mittlerer Hitze etwa zwanzig Minuten garen, bis die Ränder goldbraun sind.",
        "Viele Unternehmen suchen inzwischen Mitarbeiter, die sowohl technische als auch sprachliche Fähigkeiten "
        "mitbringen. Besonders gefragt sind Menschen, die komplizierte Abläufe verständlich erklären können und "
        "gern im Team arbeiten. Eine gute Ausbildung ist dabei wichtig, aber Erfahrung zählt oft noch mehr.",
    ],
    "fr": [
        "La mairie a annoncé que le marché du samedi se tiendra désormais sur la place de l'église pendant toute la "
        "durée des travaux. Les commerçants ont été prévenus la semaine dernière et la plupart d'entre eux se "
        "disent satisfaits de ce nouvel emplacement, plus proche des écoles et des arrêts de bus.",
        "Pour préparer une bonne soupe de légumes, il faut d'abord faire revenir les oignons et les poireaux dans "
        "un peu d'huile d'olive. On ajoute ensuite les carottes, les pommes de terre et l'eau, puis on laisse "
        "cuire à feu doux pendant une demi-heure avant de mixer le tout et de servir bien chaud.",
        "Les chercheurs ont observé que les oiseaux migrateurs arrivent chaque année un peu plus tôt dans la "
        "région. Selon eux, ce changement serait lié à la hausse des températures au printemps. Ils souhaitent "
        "poursuivre leurs observations pendant plusieurs années afin de mieux comprendre le phénomène.",
        "Le festival de musique accueillera cette année plus de quarante groupes venus de toute l'Europe. Les "
        "billets sont déjà en vente et les organisateurs conseillent aux visiteurs de réserver leur logement le "
        "plus tôt possible, car les hôtels de la ville sont souvent complets à cette période.",
    ],
    "es": [
        "El ayuntamiento ha decidido ampliar el horario de la piscina municipal durante los meses de verano. A "
        "partir del próximo lunes, las instalaciones abrirán a las ocho de la mañana y cerrarán a las diez de la "
        "noche, para que los vecinos puedan disfrutar del agua cuando hace menos calor.",
        "Para hacer una buena tortilla de patatas, primero se pelan y se cortan las patatas en trozos finos. "
        "Después se fríen a fuego lento con la cebolla hasta que estén tiernas, se mezclan con los huevos batidos "
        "y se cuaja la tortilla por los dos lados en una sartén con un poco de aceite.",
        "Los científicos del instituto han descubierto una nueva especie de rana en los bosques del norte del "
        "país. El animal es muy pequeño y tiene unos colores muy llamativos que le ayudan a protegerse de los "
        "depredadores. Según los investigadores, la especie podría estar en peligro por la pérdida de su hábitat.",
        "Muchas familias prefieren pasar las vacaciones en pueblos pequeños, lejos del ruido de las grandes "
        "ciudades. Allí pueden caminar por el campo, comer productos de la zona y descansar sin prisas. Además, "
        "los precios suelen ser más bajos que en las playas más conocidas de la costa.",
    ],
    "it": [
        "Il comune ha annunciato che la biblioteca civica resterà aperta anche la domenica mattina per tutto il "
        "mese di dicembre. I cittadini potranno prendere in prestito libri, riviste e film, oppure partecipare "
        "ai laboratori di lettura organizzati per i bambini delle scuole elementari della zona.",
        "Per preparare un buon risotto bisogna tostare il riso in una pentola con un filo d'olio e un po' di "
        "cipolla. Poi si aggiunge il brodo caldo poco alla volta, mescolando spesso, e alla fine si manteca con "
        "burro e parmigiano. Il piatto va servito subito, quando è ancora cremoso.",
        "Secondo gli esperti, la stagione turistica di quest'anno è stata migliore del previsto. Gli alberghi "
        "della costa hanno registrato molte presenze anche a settembre, grazie al bel tempo e ai numerosi "
        "visitatori stranieri che hanno scelto di scoprire le città d'arte e i piccoli borghi dell'interno.",
        "La squadra di pallavolo della città ha vinto il campionato regionale dopo una stagione molto "
        "combattuta. L'allenatore ha ringraziato i giocatori e i tifosi, che hanno seguito la squadra in tutte "
        "le trasferte, e ha detto che il prossimo obiettivo è la promozione nella serie superiore.",
    ],
    "nl": [
        "De gemeente heeft besloten om het centrum van de stad vanaf volgend jaar autovrij te maken. Bewoners "
        "kunnen hun auto parkeren in de nieuwe garage aan de rand van het centrum. De winkeliers zijn bang dat "
        "er minder klanten komen, maar de wethouder verwacht juist dat het winkelen aantrekkelijker wordt.",
        "Voor een lekkere erwtensoep heb je spliterwten, prei, wortel, knolselderij en een rookworst nodig. Laat "
        "de erwten eerst een uur zachtjes koken en voeg dan de groenten toe. De soep is het lekkerst als je hem "
        "een dag laat staan en de volgende dag opnieuw opwarmt.",
        "Onderzoekers van de universiteit hebben ontdekt dat kinderen die veel buiten spelen minder vaak last "
        "hebben van slaapproblemen. Volgens de wetenschappers is het daglicht belangrijk voor het ritme van het "
        "lichaam. Ze raden ouders aan om hun kinderen elke dag minstens een uur naar buiten te laten gaan.",
        "Het museum opent deze zomer een tentoonstelling over de geschiedenis van de scheepvaart in de haven. "
        "Bezoekers kunnen oude kaarten, modellen van schepen en persoonlijke brieven van zeelieden bekijken. "
        "Voor scholen is er een speciaal programma met rondleidingen en opdrachten voor de leerlingen.",
    ],
    "pt": [
        "A câmara municipal anunciou que as obras na avenida principal vão terminar antes do final do ano. "
        "Durante os trabalhos, os autocarros seguem um percurso alternativo e os moradores podem estacionar no "
        "parque junto ao mercado. A presidente pediu paciência aos comerciantes e aos condutores.",
        "Para fazer um bom bolo de laranja, misture primeiro os ovos com o açúcar até obter um creme claro. "
        "Junte depois o sumo e a raspa de duas laranjas, a farinha e o fermento, e leve ao forno durante cerca "
        "de quarenta minutos. Deixe arrefecer antes de desenformar e servir.",
        "Os investigadores da universidade estudaram durante vários anos a qualidade da água dos rios da região. "
        "Concluíram que a situação melhorou muito desde que as fábricas passaram a tratar os seus resíduos, mas "
        "alertam que ainda existem problemas nas zonas agrícolas, onde se usam muitos produtos químicos.",
        "Cada vez mais pessoas escolhem a bicicleta para ir para o trabalho. A cidade construiu novas ciclovias "
        "e instalou estacionamentos seguros perto das estações de comboio. Os utilizadores dizem que poupam "
        "dinheiro, fazem exercício e chegam muitas vezes mais depressa do que de carro.",
    ],
    "pl": [
        "Władze miasta zapowiedziały, że w przyszłym roku powstanie nowy park nad rzeką. Mieszkańcy będą mogli "
        "spacerować wzdłuż brzegu, jeździć na rowerze i odpoczywać na ławkach w cieniu drzew. Projekt został "
        "przygotowany po konsultacjach z sąsiadami, którzy zgłosili wiele ciekawych pomysłów.",
        "Aby przygotować dobre pierogi, trzeba najpierw zagnieść ciasto z mąki, wody i odrobiny soli. Farsz "
        "robi się z ugotowanych ziemniaków, twarogu i smażonej cebuli. Pierogi gotuje się kilka minut w osolonej "
        "wodzie, a potem można je jeszcze podsmażyć na maśle.",
        "Naukowcy z instytutu badają, dlaczego pszczoły w niektórych regionach kraju giną szybciej niż w "
        "innych. Ich zdaniem przyczyną może być zarówno pogoda, jak i środki ochrony roślin używane przez "
        "rolników. Wyniki badań mają być gotowe jesienią i zostaną przedstawione ministerstwu.",
        "Coraz więcej młodych ludzi wybiera pracę zdalną, która pozwala mieszkać poza dużym miastem. Dzięki "
        "szybkiemu internetowi mogą pracować z domu na wsi, gdzie życie jest spokojniejsze i tańsze. Firmy "
        "twierdzą, że tacy pracownicy są często bardziej zadowoleni i rzadziej zmieniają pracę.",
    ],
}

# Each language's boilerplate: cookie banner (English also a long consent text, the one most sites show: long and
# full of stop words, so jusText takes it for prose), navigation, footer lines, sidebar heading and links, newsletter
# box, byline words, share buttons. Translations are data: synthetic_boilerplate.json beside this file.
_BOILERPLATE: dict[str, dict] = json.loads(Path(__file__).with_name("synthetic_boilerplate.json").read_text("utf-8"))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def page_html(lang: str, title: str, body: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """(HTML of a page, its boilerplate as plain text): the body paragraphs inside a typical site template."""
    b = dict(_BOILERPLATE[lang])
    if "cookie_long" in b and rng.random() < 0.5:
        b["cookie"] = b["cookie_long"]
    date = f"2024-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}"
    nav = "".join(f'<li><a href="/{i}">{_escape(x)}</a></li>' for i, x in enumerate(b["nav"]))
    links = [b["links"][i] for i in rng.permutation(len(b["links"]))]
    related = "".join(f'<li><a href="/post/{i}">{_escape(x)}</a></li>' for i, x in enumerate(links))
    footer = "".join(f'<li><a href="/f{i}">{_escape(x)}</a></li>' for i, x in enumerate(b["footer"][1:]))
    paragraphs = "\n".join(f"<p>{_escape(p)}</p>" for p in body)
    html = f"""<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><title>{_escape(title)}</title>
<script>window.dataLayer = window.dataLayer || []; function gtag(){{dataLayer.push(arguments);}}</script>
<style>body {{ font-family: sans-serif; }} .cookie {{ position: fixed; bottom: 0; }}</style></head>
<body>
<div class="cookie-banner" id="consent"><span>{_escape(b["cookie"])}</span></div>
<header><nav><ul>{nav}</ul></nav></header>
<main><article>
<h1>{_escape(title)}</h1>
<div class="byline">{_escape(b["byline"])} {date}</div>
{paragraphs}
<div class="share">{_escape(b["share"])}</div>
</article>
<aside><h3>{_escape(b["related"])}</h3><ul>{related}</ul>
<div class="newsletter">{_escape(b["newsletter"])} <input type="email"><button>OK</button></div></aside>
</main>
<footer><p>{_escape(b["footer"][0])}</p><ul>{footer}</ul></footer>
</body></html>
"""
    boilerplate = " ".join(
        [b["cookie"], *b["nav"], b["byline"], date, b["share"], b["related"], *links, b["newsletter"], *b["footer"]]
    )
    return html, boilerplate


# --- junk: what a raw crawl is full of ---------------------------------------------------------------------------

_SPAM_WORDS = (
    "cheap best buy online discount free shipping price deal casino bonus win prize loan fast cash crypto "
    "replica watches pills hotel flights sale offer click now today limited exclusive top rated review"
).split()
_LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et dolore "
    "magna aliqua ut enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea commodo"
).split()
_PRODUCTS = "USB cable charger case screen protector headphones adapter mouse keyboard lamp battery".split()
JUNK_KINDS = ("keyword_spam", "link_farm", "repeated_lines", "lorem_ipsum", "price_list", "seo_template")


def junk_text(kind: str, rng: np.random.Generator) -> str:
    """One junk document of the given kind (see JUNK_KINDS)."""
    if kind == "keyword_spam":
        return " ".join(rng.choice(_SPAM_WORDS, size=int(rng.integers(80, 200))))
    if kind == "link_farm":
        lines = [
            f"{' '.join(rng.choice(_SPAM_WORDS, 3))} >> www.{rng.choice(_SPAM_WORDS)}{rng.integers(99)}.biz"
            for _ in range(int(rng.integers(20, 50)))
        ]
        return "\n".join(lines)
    if kind == "repeated_lines":
        line = f"Click here to {rng.choice(['win', 'claim', 'get'])} your free {rng.choice(_PRODUCTS)} now!!!"
        return "\n".join([line] * int(rng.integers(15, 40)))
    if kind == "lorem_ipsum":
        return "Lorem ipsum dolor sit amet, " + " ".join(rng.choice(_LOREM, size=int(rng.integers(80, 200)))) + "."
    if kind == "price_list":
        return "\n".join(
            f"{rng.choice(_PRODUCTS)} {rng.choice(_PRODUCTS)} #{rng.integers(1000, 9999)} ... ${rng.integers(1, 99)}.99"
            for _ in range(int(rng.integers(20, 60)))
        )
    if kind == "seo_template":
        city = rng.choice(["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Boston"])
        thing = rng.choice(["hotels", "flights", "plumbers", "lawyers", "dentists", "car rental"])
        sentences = [
            f"Looking for the best {thing} in {city}?",
            f"Find cheap {thing} in {city} today.",
            f"Compare {thing} {city} prices and book {thing} in {city} now.",
            f"Top rated {thing} {city} deals.",
            f"Best {thing} {city} {thing} {city} {thing} near me.",
        ]
        return " ".join(rng.choice(sentences, size=int(rng.integers(15, 40))))
    raise ValueError(f"unknown junk kind {kind!r}; choose one of {JUNK_KINDS}")


def junk_documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [junk_text(JUNK_KINDS[i % len(JUNK_KINDS)], rng) for i in range(count)]


# --- the WARC file -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrawlSpec:
    english_pages: int = 40
    pages_per_language: int = 4
    paragraphs_per_page: tuple[int, int] = (3, 6)  # English pages: uniform in [lo, hi]
    junk_pages: int = 12
    seed: int = 0
    broken_records: bool = True  # False: a clean file (for readers that stop at the first corrupt record)


CRAWL_DATE = "2024-05-01T00:00:00Z"  # every record's WARC-Date: the same bytes on every run for a seed


def _record_id(url: str) -> str:
    return f"<urn:uuid:00000000-0000-4000-8000-{zlib.crc32(url.encode()):012d}>"


def _http_response(writer, url: str, body: bytes, headers: list[tuple[str, str]], status: str = "200 OK"):
    from warcio.statusandheaders import StatusAndHeaders  # optional extra [crawl]: imported on use

    http = StatusAndHeaders(status, headers + [("Content-Length", str(len(body)))], protocol="HTTP/1.1")
    warc_headers = {"WARC-Date": CRAWL_DATE, "WARC-Record-ID": _record_id(url)}
    record = writer.create_warc_record(
        url, "response", payload=io.BytesIO(body), http_headers=http, warc_headers_dict=warc_headers
    )
    writer.write_record(record)


def _raw_record(url: str, block: bytes) -> bytes:
    """A response record written by hand, for blocks warcio's writer refuses (a garbled HTTP header)."""
    head = (
        "WARC/1.0\r\nWARC-Type: response\r\n"
        f"WARC-Target-URI: {url}\r\nWARC-Date: {CRAWL_DATE}\r\nWARC-Record-ID: {_record_id(url)}\r\n"
        f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(block)}\r\n\r\n"
    ).encode()
    return head + block + b"\r\n\r\n"


def write_synthetic_warc(
    path: str | Path, spec: CrawlSpec = CrawlSpec(), english_pages: list[dict] | None = None
) -> list[dict]:
    """Write a gzip WARC (``path``) and its truth (``path`` + ``.truth.jsonl``); return the truth records.

    Truth ``kind``: ``page`` (a good page: ``language``, ``body`` paragraphs, ``boilerplate`` text), ``junk``,
    ``not_html``, ``not_2xx``, ``broken`` (with the ``reason`` the extractor should count).

    ``english_pages`` ({"id", "title", "body": [paragraphs]}, e.g. the documents of a planted corpus) replace the
    ``spec.english_pages`` pages cut from the standard library; their truth records keep the ``id``."""
    from warcio.warcwriter import WARCWriter

    rng = np.random.default_rng(spec.seed)
    pages: list[tuple[str, str, list[str], str | None]] = []  # (language, title, body, id)
    if english_pages is None:
        lo, hi = spec.paragraphs_per_page
        paragraphs = english_paragraphs(spec.english_pages * hi)
        cursor = 0
        for _ in range(spec.english_pages):
            n = int(rng.integers(lo, hi + 1))
            chunk = paragraphs[cursor : cursor + n]
            cursor += n
            if chunk:
                pages.append(("en", f"Notes on the {chunk[0][0]} module", [p for _, p in chunk], None))
    else:
        pages += [("en", p["title"], list(p["body"]), p["id"]) for p in english_pages]
    for lang, paras in FOREIGN_PARAGRAPHS.items():
        for _ in range(spec.pages_per_language):
            order = rng.permutation(len(paras))[: int(rng.integers(2, len(paras) + 1))]
            body = [paras[i] for i in order]
            pages.append((lang, " ".join(body[0].split()[:6]), body, None))

    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=True)
    truth: list[dict] = []
    events: list[tuple[str, object]] = [("page", p) for p in pages]
    events += [("junk", JUNK_KINDS[i % len(JUNK_KINDS)]) for i in range(spec.junk_pages)]
    events += [("not_html", kind) for kind in ("image/jpeg", "application/pdf", "application/json", "text/css")]
    events += [("not_2xx", status) for status in ("301 Moved Permanently", "404 Not Found")]
    if spec.broken_records:
        events += [
            ("broken", reason)
            for reason in ("bad_http_headers", "content_decoding", "undecodable", "empty_payload", "unreadable_record")
        ]
    order = rng.permutation(len(events))
    info = writer.create_warcinfo_record(Path(path).name, {"software": "mtnlg synthetic crawl"})
    info.rec_headers.replace_header("WARC-Date", CRAWL_DATE)
    info.rec_headers.replace_header("WARC-Record-ID", _record_id(f"warcinfo:{spec.seed}"))
    writer.write_record(info)
    for n, i in enumerate(order):
        kind, what = events[i]
        url = f"https://site{n % 17}.example/{spec.seed}/{kind}/{n}"
        if kind == "page":
            lang, title, body, page_id = what
            html, boilerplate = page_html(lang, title, body, rng)
            _http_response(writer, url, html.encode("utf-8"), [("Content-Type", "text/html; charset=utf-8")])
            truth.append(
                {"url": url, "kind": kind, "language": lang, "title": title, "body": body, "boilerplate": boilerplate}
                | ({"id": page_id} if page_id is not None else {})
            )
        elif kind == "junk":
            text = junk_text(what, rng)
            html = (
                "<html><body>" + "".join(f"<div>{_escape(line)}</div>" for line in text.split("\n")) + "</body></html>"
            )
            _http_response(writer, url, html.encode("utf-8"), [("Content-Type", "text/html")])
            truth.append({"url": url, "kind": kind, "junk": what, "text": text})
        elif kind == "not_html":
            payload = {
                "image/jpeg": b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
                "application/pdf": b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF",
                "application/json": b'{"items": [1, 2, 3]}',
                "text/css": b"body { margin: 0 }",
            }[what]
            _http_response(writer, url, payload, [("Content-Type", what)])
            truth.append({"url": url, "kind": kind, "reason": "not_html"})
        elif kind == "not_2xx":
            _http_response(writer, url, b"<html><body>moved</body></html>", [("Content-Type", "text/html")], what)
            truth.append({"url": url, "kind": kind, "reason": "http_status_not_2xx"})
        else:
            _write_broken(writer, buf, url, what)
            truth.append({"url": url, "kind": kind, "reason": what})
    Path(path).write_bytes(buf.getvalue())
    with open(f"{path}.truth.jsonl", "w", encoding="utf-8") as f:
        for t in truth:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    return truth


def _write_broken(writer, buf: io.BytesIO, url: str, reason: str) -> None:
    html = b"<html><body><p>This page is broken in transit and must be counted, not extracted.</p></body></html>"
    if reason == "bad_http_headers":
        garbled = _raw_record(url, b"GARBLED STATUS LINE\r\nno headers here\r\n\r\n" + html)
        buf.write(gzip.compress(garbled, mtime=0))
    elif reason == "content_decoding":  # says gzip, is not
        _http_response(
            writer,
            url,
            b"\x1f\x8b\x08\x00not really gzip" + html,
            [("Content-Type", "text/html"), ("Content-Encoding", "gzip")],
        )
    elif reason == "undecodable":  # declared UTF-8, holds Latin-1 bytes
        _http_response(
            writer,
            url,
            "<html><body><p>Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e</p></body></html>".encode("latin-1"),
            [("Content-Type", "text/html; charset=utf-8")],
        )
    elif reason == "empty_payload":
        _http_response(writer, url, b"", [("Content-Type", "text/html")])
    elif reason == "unreadable_record":  # a gzip member whose bytes are corrupt
        member = bytearray(gzip.compress(_raw_record(url, b"HTTP/1.1 200 OK\r\n\r\n" + html), mtime=0))
        member[12:40] = b"\x00" * 28
        buf.write(bytes(member))
    else:
        raise ValueError(f"unknown broken record {reason!r}")


# --- scoring an extraction against the truth ---------------------------------------------------------------------

_WORD = re.compile(r"\w+", re.UNICODE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def score_extraction(truth: list[dict], documents: list[dict]) -> dict:
    """Compare extracted documents (by url) with the planted pages: pages found, body words kept, boilerplate words
    left (words of the page's boilerplate that are neither body nor title words: a page's heading is kept by design
    and is neither), language accuracy."""
    by_url = {d["url"]: d for d in documents}
    pages = [t for t in truth if t["kind"] == "page"]
    found = body_total = body_kept = boiler_total = boiler_left = right_language = 0
    missing, wrong_language = [], []
    for t in pages:
        doc = by_url.get(t["url"])
        if doc is None:
            missing.append(t["url"])
            continue
        found += 1
        got = Counter(_words(doc["text"])) - Counter(_words(t.get("title", "")))
        body = Counter(_words(" ".join(t["body"])))
        boiler = Counter(_words(t["boilerplate"]))
        body_total += sum(body.values())
        body_kept += sum((got & body).values())
        boiler_total += sum(boiler.values())
        boiler_left += sum(((got - body) & boiler).values())
        if doc["language"] == t["language"]:
            right_language += 1
        else:
            wrong_language.append((t["url"], t["language"], doc["language"]))
    return {
        "pages": len(pages),
        "pages_found": found,
        "missing": missing,
        "body_words_kept": body_kept / max(1, body_total),
        "boilerplate_words_left": boiler_left / max(1, boiler_total),
        "language_accuracy": right_language / max(1, found),
        "wrong_language": wrong_language,
    }
