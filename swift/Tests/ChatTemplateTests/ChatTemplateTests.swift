import XCTest
import ChatTemplate

/// The renderer against jinja2: every expected string below is what jinja2 3.1 renders for the
/// same template (ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks on, tojson as
/// json.dumps(ensure_ascii=False)), as transformers' apply_chat_template renders.
final class ChatTemplateRenderTests: XCTestCase {
    /// The conversation the `chat` cases read.
    let chat: [String: ChatValue] = [
        "messages": [
            ["role": "system", "content": "Be brief."],
            ["role": "user", "content": " Hi \"you\" \\ é 日本語 😀\n"],
            ["role": "assistant", "content": "Hello."],
        ],
        "add_generation_prompt": true,
        "bos_token": "<s>",
        "eos_token": "</s>",
    ]

    func render(_ source: String, _ context: [String: ChatValue] = [:]) throws -> String {
        try ChatTemplate(source).render(context: context)
    }

    func testLiterals() throws {
        XCTAssertEqual(try render("{{ 'a' }}{{ \"b\" }}{{ 'it''s' }}{{ 'x' \"y\" }}"), "abitsxy")
        XCTAssertEqual(try render("{{ 'a\\tb\\n\\\\\\'\\x41\\101\\u00e9\\U0001F600\\d' }}"), "a\tb\n\\'AAé😀\\d")
        XCTAssertEqual(try render("{{ 42 }} {{ -7 }} {{ 1_000 }} {{ 0x1f }} {{ 0o17 }} {{ 0b101 }}"), "42 -7 1000 31 15 5")
        XCTAssertEqual(try render("{{ 1.5 }} {{ 1.0 }} {{ 1e3 }} {{ 2.5e-3 }} {{ 1e16 }} {{ 1e-5 }} {{ 0.1 + 0.2 }} {{ 1e15 }}"), "1.5 1.0 1000.0 0.0025 1e+16 1e-05 0.30000000000000004 1000000000000000.0")
        XCTAssertEqual(try render("{{ true }} {{ True }} {{ false }} {{ False }} {{ none }} {{ None }}"), "True True False False None None")
        XCTAssertEqual(try render("{{ [1, 'a', none, true, 1.5, [], {}] }} {{ (1,) }} {{ (1, 'b') }} {{ () }}"), "[1, 'a', None, True, 1.5, [], {}] (1,) (1, 'b') ()")
        XCTAssertEqual(try render("{{ {'a': 1, 'b': \"it's\", 'c': 'say \"x\"'} }} {{ {'k': 'v', } }} {{ [1, 2, ] }}"), "{'a': 1, 'b': \"it's\", 'c': 'say \"x\"'} {'k': 'v'} [1, 2]")
        XCTAssertEqual(try render("{{ 'a\\x00\\u2028' }}|{{ ['a\\x00\\u2028b', 'é', 'tab\\t'] }}"), "a\u{0}\u{2028}|['a\\x00\\u2028b', 'é', 'tab\\t']")
    }

    func testAccess() throws {
        XCTAssertEqual(try render("{{ messages[0].role }}|{{ messages[0]['content'] }}|{{ messages.1.role }}|{{ messages[-1].content }}", chat), "system|Be brief.|user|Hello.")
        XCTAssertEqual(try render("{{ messages[1:]|length }}|{{ messages[::-1][0].role }}|{{ messages[:1][0].role }}|{{ messages[5:] }}|{{ messages[-1:0:-1]|length }}", chat), "2|assistant|system|[]|2")
        XCTAssertEqual(try render("{{ 'abcdef'[1:5:2] }}|{{ 'abc'[::-1] }}|{{ 'abc'[5] }}|{{ '日本語'[1] }}|{{ 'héllo'[1:3] }}", chat), "bd|cba||本|él")
        XCTAssertEqual(try render("{{ messages[0].nope }}|{{ messages[9] }}|{{ messages[0]['nope'] }}|{{ nothing }}", chat), "|||")
        XCTAssertEqual(try render("{{ messages[0].items()|list }}|{{ messages[0]['role'] }}", chat), "[('role', 'system'), ('content', 'Be brief.')]|system")
    }

    func testOperators() throws {
        XCTAssertEqual(try render("{{ 1 + 2 }} {{ 5 - 7 }} {{ 2 * 3 }} {{ 7 / 2 }} {{ 10 / 5 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}"), "3 -2 6 3.5 2.0 3 -4 2 -2 1024 0.5")
        XCTAssertEqual(try render("{{ 7.5 // 2 }} {{ -7.5 // 2 }} {{ 7.5 % -2 }} {{ 1 + 1.5 }} {{ true + 1 }}"), "3.0 -4.0 -0.5 2.5 2")
        XCTAssertEqual(try render("{{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ 2 * 'x' }} {{ [0] * 3 }}"), "ab [1, 2] ababab xx [0, 0, 0]")
        XCTAssertEqual(try render("{{ 'a' ~ 1 ~ none ~ true ~ 1.5 ~ [1] }} {{ 'x' ~ undefined_name ~ 'y' }}"), "a1NoneTrue1.5[1] xy")
        XCTAssertEqual(try render("{{ -2 ** 2 }} {{ 2 ** 3 ** 2 }} {{ 10 - 2 - 3 }} {{ 2 * 3 + 4 }} {{ 7 % 3 * 2 }} {{ 3 - -1 }}"), "4 64 5 10 2 4")
        XCTAssertEqual(try render("{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' != 'b' }} {{ 'a' < 'b' }} {{ 'B' < 'a' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 1 < 2 < 3 }} {{ 1 < 2 > 3 }}"), "True True True True True True True True False")
        XCTAssertEqual(try render("{{ 'ab' in 'cabd' }} {{ 1 in [1, 2] }} {{ 'a' in {'a': 1} }} {{ 3 not in [1, 2] }} {{ 'x' in nothing }}"), "True True True True False")
        XCTAssertEqual(try render("{{ 1 and 'y' }}|{{ 0 and 'y' }}|{{ 0 or 'x' }}|{{ '' or [] }}|{{ not 0 }}|{{ not 'a' in 'abc' }}|{{ not 1 == 2 }}"), "y|0|x|[]|True|False|True")
        XCTAssertEqual(try render("{{ 'yes' if 1 else 'no' }}|{{ 'yes' if 0 else 'no' }}|{{ 'a' if false }}|{{ 'b' if 1 > 2 else 'c' if 2 > 1 else 'd' }}"), "yes|no||c")
    }

    func testTests() throws {
        XCTAssertEqual(try render("{{ x is defined }}{{ x is undefined }}{{ messages is defined }}{{ messages[0].nope is defined }}", chat), "FalseTrueTrueFalse")
        XCTAssertEqual(try render("{{ none is none }}{{ 0 is none }}{{ 'a' is string }}{{ 1 is string }}{{ 1 is number }}{{ 1.5 is number }}{{ true is number }}", chat), "TrueFalseTrueFalseTrueTrueTrue")
        XCTAssertEqual(try render("{{ 1 is integer }}{{ true is integer }}{{ 1.5 is integer }}{{ 1.5 is float }}{{ 1 is float }}", chat), "TrueFalseFalseTrueFalse")
        XCTAssertEqual(try render("{{ {} is mapping }}{{ [] is mapping }}{{ messages[0] is mapping }}", chat), "TrueFalseTrue")
        XCTAssertEqual(try render("{{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}{{ x is iterable }}{{ [] is sequence }}{{ 'a' is sequence }}{{ {} is sequence }}{{ 1 is sequence }}", chat), "TrueTrueFalseTrueTrueTrueTrueFalse")
        XCTAssertEqual(try render("{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 0 is false }}{{ true is boolean }}{{ 1 is boolean }}", chat), "TrueFalseTrueFalseTrueFalse")
        XCTAssertEqual(try render("{{ 3 is odd }}{{ 3 is even }}{{ 4 is even }}{{ -3 is odd }}{{ 3.0 is odd }}", chat), "TrueFalseTrueTrueTrue")
        XCTAssertEqual(try render("{{ x is not defined }}{{ none is not none }}{{ messages is not string }}", chat), "TrueFalseTrue")
    }

    func testFilters() throws {
        XCTAssertEqual(try render("[{{ '  a b  '|trim }}][{{ 'xxaxx'|trim('x') }}][{{ nothing|trim }}][{{ '\\u3000x\\t'|trim }}]", chat), "[a b][a][][x]")
        XCTAssertEqual(try render("{{ messages[0]|tojson }}|{{ messages|tojson }}", chat), "{\"role\": \"system\", \"content\": \"Be brief.\"}|[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \" Hi \\\"you\\\" \\\\ é 日本語 😀\\n\"}, {\"role\": \"assistant\", \"content\": \"Hello.\"}]")
        XCTAssertEqual(try render("{{ {'a': [1, 'x', none, true, 1.5, {}], 'b': []}|tojson(indent=2) }}|{{ [1]|tojson(indent=0) }}|{{ {'a': 1}|tojson(indent='\\t') }}|{{ {}|tojson(indent=2) }}", chat), "{\n  \"a\": [\n    1,\n    \"x\",\n    null,\n    true,\n    1.5,\n    {}\n  ],\n  \"b\": []\n}|[\n1\n]|{\n\t\"a\": 1\n}|{}")
        XCTAssertEqual(try render("{{ 'é\"\\\\\\n\\x01\\x7f\\u2028'|tojson }}|{{ 1e20|tojson }}|{{ 1.0|tojson }}|{{ 'a'|tojson(2) }}", chat), "\"é\\\"\\\\\\n\\u0001\u{7f}\u{2028}\"|1e+20|1.0|\"a\"")
        XCTAssertEqual(try render("{{ messages|length }}{{ 'é日😀'|length }}{{ {'a': 1}|count }}{{ nothing|length }}", chat), "3310")
        XCTAssertEqual(try render("{{ messages|first|tojson }}|{{ (messages|last).role }}|{{ 'abc'|first }}{{ 'abc'|last }}|{{ []|first }}|{{ {'a': 1, 'b': 2}|first }}{{ {'a': 1, 'b': 2}|last }}", chat), "{\"role\": \"system\", \"content\": \"Be brief.\"}|assistant|ac||ab")
        XCTAssertEqual(try render("{{ [1, 'a', none]|join }}|{{ ['a', 'b']|join(', ') }}|{{ messages|join('/', attribute='role') }}|{{ 'abc'|join('-') }}", chat), "1aNone|a, b|system/user/assistant|a-b-c")
        XCTAssertEqual(try render("{{ nothing|default('d') }}|{{ ''|default('e') }}|{{ ''|default('e', true) }}|{{ ''|d('e', boolean=true) }}|{{ none|default('n') }}|{{ nothing|d }}", chat), "d||e|e|None|")
        XCTAssertEqual(try render("{{ 'AbC'|lower }}{{ 'abc'|upper }}{{ 'hello WORLD'|capitalize }}{{ 'ß'|upper }}{{ 'ÉCOLE'|lower }}", chat), "abcABCHello worldSSécole")
        XCTAssertEqual(try render("{{ \"hello world-foo(bar they're\"|title }}|{{ 42|string ~ 'x' }}|{{ none|string }}", chat), "Hello World-Foo(Bar They're|42x|None")
        XCTAssertEqual(try render("{{ '12'|int + 1 }} {{ ' -5 '|int }} {{ '5.9'|int }} {{ 5.9|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ true|int }} {{ 'ff'|int(base=16) }} {{ '1_000'|int }}", chat), "13 -5 5 5 0 7 1 255 1000")
        XCTAssertEqual(try render("{{ 'abc'|list }}|{{ {'a': 1}|list }}|{{ nothing|list }}|{{ (1, 2)|list }}", chat), "['a', 'b', 'c']|['a']|[]|[1, 2]")
        XCTAssertEqual(try render("{{ [3, 1, 2]|reverse|list }}|{{ 'abc'|reverse }}|{{ {'a': 1, 'b': 2}|reverse|list }}", chat), "[2, 1, 3]|cba|['b', 'a']")
        XCTAssertEqual(try render("{{ messages[0]|items|list }}|{% for k, v in {'a': 1, 'b': 2}|items %}{{ k }}={{ v }};{% endfor %}", chat), "[('role', 'system'), ('content', 'Be brief.')]|a=1;b=2;")
        XCTAssertEqual(try render("{{ 'a,b,c'|replace(',', ';') }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'ab'|replace('', '-') }}|{{ '<b>'|safe }}", chat), "a;b;c|bba|-a-b-|<b>")
        XCTAssertEqual(try render("{{ 'A B'|lower|replace(' ', '_')|upper }}", chat), "A_B")
    }

    func testMethods() throws {
        XCTAssertEqual(try render("[{{ ' a '.strip() }}][{{ ' a '.lstrip() }}][{{ ' a '.rstrip() }}][{{ 'xyx'.strip('x') }}][{{ 'xyx'.lstrip('x') }}][{{ 'xyx'.rstrip('x') }}]", chat), "[a][a ][ a][y][yx][xy]")
        XCTAssertEqual(try render("{{ 'abc'.startswith('ab') }}{{ 'abc'.startswith(('x', 'a')) }}{{ 'abc'.endswith('bc') }}{{ 'abc'.endswith('') }}{{ 'abc'.endswith('x') }}", chat), "TrueTrueTrueTrueFalse")
        XCTAssertEqual(try render("{{ '  a b  '.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a b c'.split(' ', 1) }}{{ ' a b  c '.split(none, 1) }}{{ ''.split() }}{{ ''.split(',') }}", chat), "['a', 'b']['a', 'b', '', 'c']['a', 'b c']['a', 'b  c '][]['']")
        XCTAssertEqual(try render("{{ 'aB'.upper() }}{{ 'aB'.lower() }}{{ 'a-b-c'.replace('-', '+') }}{{ 'a-b-c'.replace('-', '+', 1) }}{{ '1st hello WORLD'.title() }}{{ \"they're\".title() }}", chat), "ABaba+b+ca+b-c1St Hello WorldThey'Re")
        XCTAssertEqual(try render("{{ messages[0].items()|list }}|{{ messages[0].keys()|list }}|{{ messages[0].values()|list }}", chat), "[('role', 'system'), ('content', 'Be brief.')]|['role', 'content']|['system', 'Be brief.']")
        XCTAssertEqual(try render("{{ messages[0].get('role') }}|{{ messages[0].get('x') }}|{{ messages[0].get('x', 5) }}|{{ messages[0].get('x') is none }}", chat), "system|None|5|True")
    }

    func testLoops() throws {
        XCTAssertEqual(try render("{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }} {% endfor %}", chat), "10TrueFalse332 21FalseFalse321 32FalseTrue310 ")
        XCTAssertEqual(try render("{% for i in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }},{% endfor %}", chat), "-2,1-3,2-,")
        XCTAssertEqual(try render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }}{% if not loop.last %}, {% endif %}{% endfor %}", chat), "a=1, b=2")
        XCTAssertEqual(try render("{% for i in [1, 2, 3, 4] if i is even %}{{ loop.index }}/{{ loop.length }}:{{ i }} {% endfor %}", chat), "1/2:2 2/2:4 ")
        XCTAssertEqual(try render("{% for m in messages if m.role == 'tool' %}{{ m }}{% else %}no tools{% endfor %}", chat), "no tools")
        XCTAssertEqual(try render("{% for c in 'hé😀' %}{{ c }}.{% endfor %}{% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %}{% for a in nothing %}never{% endfor %}", chat), "h.é.😀.xy")
        XCTAssertEqual(try render("{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }}{% endfor %}|{% for i in [1] %}{% for j in [2, 3] %}{{ loop.index }}{{ i }}{{ j }}{% endfor %}{{ loop.index }}{% endfor %}", chat), "1234|1122131")
        XCTAssertEqual(try render("{% for m in messages[::-1] %}{{ m.role[0] }}{% endfor %}|{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(1, 7, 2) %}{{ i }}{% endfor %}", chat), "aus|012135")
    }

    func testAssignments() throws {
        XCTAssertEqual(try render("{% set x = 0 %}{% for i in [1, 2, 3] %}{{ x }}{% set x = x + i %}{{ x }},{% endfor %}{{ x }}", chat), "01,02,03,0")
        XCTAssertEqual(try render("{% for i in [1, 2] %}{% if i == 2 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}", chat), "[]")
        XCTAssertEqual(try render("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", chat), "2")
        XCTAssertEqual(try render("{% set ns = namespace(found=false, count=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.found = true %}{% endif %}{% set ns.count = ns.count + 1 %}{% endfor %}{{ ns.found }} {{ ns.count }} {{ ns.missing }}", chat), "True 3 ")
        XCTAssertEqual(try render("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, d = 'xy' %}{{ d }}{{ c }}", chat), "12yx")
        XCTAssertEqual(try render("{% set ns = namespace({'z': 3}, w=4) %}{{ ns.z }}{{ ns.w }}{{ ns }}", chat), "34<Namespace {'z': 3, 'w': 4}>")
        XCTAssertEqual(try render("{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}{% else %}{% set system = 'default' %}{% set rest = messages %}{% endif %}{{ system }}:{{ rest|length }}", chat), "Be brief.:2")
    }

    func testConditionals() throws {
        XCTAssertEqual(try render("{% if 1 %}a{% elif 2 %}b{% else %}c{% endif %}{% if 0 %}a{% elif 2 %}b{% else %}c{% endif %}{% if 0 %}a{% elif 0 %}b{% else %}c{% endif %}{% if 0 %}a{% endif %}", chat), "abc")
        XCTAssertEqual(try render("{% if messages[0].role not in ['user', 'assistant'] %}first is {{ messages[0].role }}{% endif %}", chat), "first is system")
        XCTAssertEqual(try render("{% if add_generation_prompt and messages[-1].role != 'assistant' %}gen{% else %}no{% endif %}", chat), "no")
    }

    func testWhitespace() throws {
        XCTAssertEqual(try render("a\n  {% if true %}\n  b\n  {% endif %}\nc"), "a\n  b\nc")
        XCTAssertEqual(try render("{{ 'x' }}  {% if true %}y{% endif %}"), "x  y")
        XCTAssertEqual(try render("{% if true -%}  \n  {% if true %}q{% endif %}{% endif %}"), "q")
        XCTAssertEqual(try render("  {%- if true %} a {% endif -%}  \n b"), " a b")
        XCTAssertEqual(try render("{%+ if true %}  x{% endif +%}\ny"), "  x\ny")
        XCTAssertEqual(try render("   {{+ 'a' }}|  {{ 'b' }}"), "   a|  b")
        XCTAssertEqual(try render("{{- 'a' -}}\n\n{{- 'b' }}\n  {{ 'c' }}"), "ab\n  c")
        XCTAssertEqual(try render("{{ 'a' -}}    {{ 'b' }}"), "ab")
        XCTAssertEqual(try render("\n  {% for i in [1, 2] %}\n    {{ i }}\n  {% endfor %}\n"), "\n    1\n    2\n")
        XCTAssertEqual(try render("x {% if false %}y{% endif %}\n{% if true %}z{% endif %}"), "x z")
        XCTAssertEqual(try render("{{ 'a' }}\n{% if true %}\nb{% endif %}"), "a\nb")
        XCTAssertEqual(try render("a\r\nb\rc\n"), "a\nb\nc")
        XCTAssertEqual(try render("x\n\n"), "x\n")
        XCTAssertEqual(try render("{%- set x = 'a' -%}\n\n  {{ x }}  \n"), "a  ")
        XCTAssertEqual(try render("{% for m in [1, 2] %}\n{{ m }}\n{% endfor %}\n"), "1\n2\n")
    }

    func testCommentsAndRaw() throws {
        XCTAssertEqual(try render("  {# c #}\nx  {#- c #} y {# c -#}  \n z"), "x y z")
        XCTAssertEqual(try render("{# a #}\n{# b -#}\n\n  c {#- d #}"), "c")
        XCTAssertEqual(try render("{# {{ not rendered }} {% if %} #}ok"), "ok")
        XCTAssertEqual(try render("{% raw %}\n{{ x }}{% endraw %}\nz"), "\n{{ x }}z")
        XCTAssertEqual(try render("{% raw %}{{ x }}{% endraw %}|{%- raw -%}  a  {%- endraw -%}  |"), "{{ x }}|a|")
        XCTAssertEqual(try render("  {% raw %}\n  x {% if %}\n  {% endraw %}\nz"), "\n  x {% if %}\nz")
    }

}

final class ChatTemplateAPITests: XCTestCase {
    let smolLM2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

    func testMessagesAndVariables() throws {
        let template = try ChatTemplate(smolLM2)
        let messages = [ChatMessage(role: "user", content: "Hi")]
        XCTAssertEqual(try template.render(messages: messages, addGenerationPrompt: true),
                       "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                       + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        XCTAssertEqual(try template.render(messages: [ChatMessage(role: "system", content: "S")] + messages, addGenerationPrompt: false),
                       "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
        let bos = try ChatTemplate("{{ bos_token }}{{ messages[0] | tojson }}{{ add_generation_prompt }}")
        XCTAssertEqual(try bos.render(messages: messages, addGenerationPrompt: false, variables: ["bos_token": "<s>"]),
                       "<s>{\"role\": \"user\", \"content\": \"Hi\"}False")
    }

    func testMessagesFromJSONKeepKeyOrder() throws {
        let value = try ChatValue.parseJSON(#"[{"content": "a\u00e9\ud83d\ude00\n", "role": "user", "n": [1, 2.5, true, null]}]"#)
        guard case .array(let messages) = value else { return XCTFail("not a list") }
        let text = try ChatTemplate("{{ messages[0]|tojson }}").render(messages: messages, addGenerationPrompt: false)
        XCTAssertEqual(text, #"{"content": "aé😀\n", "role": "user", "n": [1, 2.5, true, null]}"#)
        XCTAssertThrowsError(try ChatValue.parseJSON("[1,"))
        XCTAssertThrowsError(try ChatValue.parseJSON("{\"a\": 1} x"))
    }

    func testRaiseExceptionThrowsItsMessage() throws {
        let template = try ChatTemplate("line one\n{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Unknown role: ' ~ m.role) }}{% endif %}{% endfor %}")
        XCTAssertNoThrow(try template.render(messages: [ChatMessage(role: "user", content: "x")], addGenerationPrompt: false))
        XCTAssertThrowsError(try template.render(messages: [ChatMessage(role: "robot", content: "x")], addGenerationPrompt: false)) { error in
            let error = error as! ChatTemplateError
            XCTAssertEqual(error.kind, .raised(message: "Unknown role: robot"))
            XCTAssertEqual(error.line, 2)
            XCTAssertTrue(error.description.hasPrefix("chat template line 2: "), error.description)
            XCTAssertTrue(error.description.contains("Unknown role: robot"), error.description)
        }
    }

    /// A construct outside the subset is refused by init, named, on its line, in one line.
    func testRefusalsNameTheConstruct() {
        let cases: [(String, String, Int)] = [
            ("a\n\n{% macro f() %}x{% endmacro %}", "{% macro %}", 3),
            ("{% call f() %}{% endcall %}", "{% call %}", 1),
            ("{% filter upper %}a{% endfilter %}", "{% filter %}", 1),
            ("{% include 'x.jinja' %}", "{% include %}", 1),
            ("{% import 'x' as y %}", "{% import %}", 1),
            ("{% from 'x' import y %}", "{% from %}", 1),
            ("{% extends 'base' %}", "{% extends %}", 1),
            ("{% block b %}{% endblock %}", "{% block %}", 1),
            ("{% with a = 1 %}{% endwith %}", "{% with %}", 1),
            ("{% set x %}a{% endset %}", "{% set %} block", 1),
            ("{% for x in y recursive %}{% endfor %}", "{% for ... recursive %}", 1),
            ("x\n{{ strftime_now('%d %b %Y') }}", "function strftime_now()", 2),
            ("{{ messages|map(attribute='role')|list }}", "filter map", 1),
            ("{{ messages|selectattr('role', 'equalto', 'user')|list }}", "filter selectattr", 1),
            ("{% if x is divisibleby 3 %}{% endif %}", "test divisibleby", 1),
            ("{{ '{}'.format(1) }}", "method .format()", 1),
            ("{% for m in messages %}{{ loop.cycle('a', 'b') }}{% endfor %}", "method .cycle()", 1),
            ("{{ f(*args) }}", "function f()", 1),
            ("{{ range(*args) }}", "*args or **kwargs in a call", 1),
            ("{{ messages[0]['role']() }}", "a call of a computed value", 1),
        ]
        for (source, construct, line) in cases {
            XCTAssertThrowsError(try ChatTemplate(source), source) { error in
                guard let error = error as? ChatTemplateError else { return XCTFail("\(error)") }
                XCTAssertEqual(error.kind, .unsupported(construct: construct), source)
                XCTAssertEqual(error.line, line, source)
                XCTAssertTrue(error.description.hasPrefix("chat template line \(line): \(construct) "), error.description)
                XCTAssertFalse(error.description.contains("\n"))
            }
        }
    }

    func testInvalidJinjaIsASyntaxError() {
        for source in ["{# unclosed", "{{ 'abc", "{% for %}", "{% if x %}", "{% endif %}", "{{ }}", "{% frobnicate %}", "{{ (1 }}", "{{ a ! b }}"] {
            XCTAssertThrowsError(try ChatTemplate(source), source) { error in
                XCTAssertEqual((error as? ChatTemplateError)?.kind, .syntax, "\(source): \(error)")
            }
        }
    }

    /// Where jinja2 raises while rendering (UndefinedError, TypeError, ZeroDivisionError), so does the renderer.
    func testRenderErrors() throws {
        for source in ["{{ x.y }}", "{{ x['y'] }}", "{{ x + 1 }}", "{{ x.strip() }}", "{{ x|int }}", "{{ x|tojson }}", "{{ x is odd }}",
                       "{{ messages[0].nope.z }}", "{{ 1 / 0 }}", "{{ 7 // 0 }}", "{{ 'a' + 1 }}", "{{ -'a' }}", "{{ none|length }}",
                       "{% for a in 1 %}{% endfor %}", "{% set x = 1 %}{% set x.y = 2 %}", "{{ 1 < 'a' }}", "{{ 1 in 'abc' }}",
                       "{{ namespace(a=1)|tojson }}", "{% set a, b = [1] %}"] {
            let template = try ChatTemplate(source)
            XCTAssertThrowsError(try template.render(messages: [ChatMessage(role: "user", content: "x")], addGenerationPrompt: false), source) { error in
                XCTAssertEqual((error as? ChatTemplateError)?.kind, .runtime, "\(source): \(error)")
            }
        }
    }
}
