"""Varied chat prompts for reference tests: short and long, English, CJK, emoji, code."""

LONG_CONTEXT = (
    "The history of the printing press begins in the fifteenth century. Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that "
    "could produce books far faster than scribes. Within fifty years presses operated in more than two "
    "hundred European cities, and millions of volumes had been printed. The spread of printed material "
    "changed religion, science and politics: pamphlets carried arguments quickly, scientists could share "
    "exact copies of diagrams and tables, and literacy rose as books became cheaper. "
)

CHAT_PROMPTS: list[str] = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "日本の首都はどこですか？簡単に説明してください。",
    "请用中文介绍一下长城。",
    "Explain what this emoji sequence means: 🚀🌕👨‍🚀🎉",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a Python function that checks whether a number is prime.",
    LONG_CONTEXT * 4 + "\n\nSummarise the passage above in two sentences.",
    "Café, naïve, résumé: what do the accents in these words do?",
]

EXTRA_PROMPTS: list[str] = [
    "Hi!",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Describe a sunset over the mountains in one paragraph.",
    "Give me a recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    LONG_CONTEXT * 2 + "\n\nWhat did Gutenberg combine?",
]

SIXTEEN_PROMPTS = CHAT_PROMPTS + EXTRA_PROMPTS
