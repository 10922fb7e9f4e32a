"""Fixed chat prompts for the real model: the demo's customer-service traffic and the accuracy set.

Written for this project (no third-party text). `SUPPORT_SYSTEM_PROMPT` is a believable shop
assistant's instructions, long enough (414 tokens with SmolLM2's tokenizer, ~430 inside the chat
template) that sharing it is what a prefix cache is for; `SUPPORT_QUESTIONS` are what that
shop's customers ask; `GENERAL_QUESTIONS` are everyday questions with no system prompt of their
own. The lists are fixed: the accuracy benchmark compares greedy answers to them across engines
and KV dtypes, so changing one changes every figure measured before.
"""

from __future__ import annotations

SUPPORT_SYSTEM_PROMPT = """\
You are Juniper, the customer-service assistant of Brightwater Outfitters, an online shop that \
sells tents, sleeping bags, backpacks, hiking boots, rain jackets and camping stoves.

How to answer:
- Be friendly, brief and concrete: two to four sentences unless the customer asks for detail.
- Never invent an order status, a tracking number or a price. If the customer needs something \
only a person can see or change, say that a colleague will reply by email within one business day.
- Do not ask for card numbers or passwords. An order number (eight digits starting with BW) is enough.

What you know about the shop:
- Shipping: standard delivery takes three to five business days and is free above 50 dollars, \
otherwise 6 dollars. Express delivery takes one to two business days and costs 15 dollars. \
Orders placed before 2 pm ship the same day. We ship to the United States and Canada only.
- Returns: unused items can be returned within 60 days for a full refund; worn boots and used \
stoves within 30 days if they are faulty. Return labels are free. Refunds reach the original \
payment method within seven days of the return arriving at our warehouse.
- Warranty: tents, backpacks and sleeping bags carry a five-year warranty against defects in \
materials and workmanship; stoves carry two years. Normal wear, fire damage and misuse are not covered.
- Repairs: we repair zips, seams and tent poles for a flat 25 dollars plus shipping.
- Customer service hours: Monday to Friday, 8 am to 6 pm Mountain Time. The shop in Boulder, \
Colorado, is open every day from 10 am to 7 pm.
- Gift cards never expire and can be used online and in the shop.
- Price match: if another shop sells the same item for less within 14 days of your purchase, \
we refund the difference.
"""

SUPPORT_QUESTIONS = (
    "Hi, how long does standard shipping take?",
    "Is shipping free if my order is 45 dollars?",
    "Can I get my tent by Saturday if I order today, Wednesday?",
    "Do you ship to Mexico?",
    "I ordered at 3 pm, when will my order ship?",
    "How much does express delivery cost?",
    "Can I return a sleeping bag I bought five weeks ago? I never used it.",
    "My hiking boots started leaking after two weeks. Can I return them even though I wore them?",
    "How long does it take to get my money back after a return?",
    "Do I have to pay for the return label?",
    "What does the warranty on a backpack cover?",
    "The zip on my tent broke after three years. Is that covered?",
    "My stove got damaged when I left it too close to the campfire. Will you replace it?",
    "How much does it cost to repair a tent pole?",
    "Can you fix a torn seam on my rain jacket?",
    "What are your customer service hours?",
    "Is the Boulder shop open on Sundays?",
    "Do gift cards expire?",
    "Can I use a gift card in the shop in Boulder?",
    "I saw the same backpack 20 dollars cheaper somewhere else. What can you do?",
    "I bought a tent a month ago and now it's on sale elsewhere. Can I get the difference back?",
    "Where is my order? The number is BW20451187.",
    "Can you give me a tracking number for my order?",
    "I want to change the delivery address on my order.",
    "Can I pay you by card over chat? Here is my number.",
    "What is your password reset process?",
    "Which tent would you recommend for two people in the rain?",
    "What sleeping bag should I take for nights around freezing?",
    "Do you sell camping stoves that work at high altitude?",
    "My order arrived with a missing tent peg bag. What should I do?",
    "I received the wrong size of boots. How do I exchange them?",
    "Can I return an item I bought in the shop by mail?",
    "Can I cancel my order? I placed it ten minutes ago.",
    "Do you offer student discounts?",
    "Can I order by phone?",
    "Are your prices in US or Canadian dollars?",
    "How do I clean my down sleeping bag?",
    "How should I store my tent over the winter?",
    "My rain jacket is no longer waterproof. Is that a defect?",
    "Do you have a loyalty program?",
    "Can I pick up my online order in the Boulder shop?",
    "What happens if my package is lost in transit?",
    "The box was damaged when it arrived but the tent looks fine. Should I worry?",
    "Is the five-year warranty transferable if I sell my backpack?",
    "Can you send me a repair quote before I ship my tent?",
    "I'm in Canada. How long will standard delivery take?",
    "Do you sell replacement tent poles?",
    "What is the difference between standard and express delivery?",
    "I returned a stove two weeks ago and have not seen my refund. Why?",
    "Can I return a gift without the receipt?",
    "Do you rent tents?",
    "How do I know which backpack size fits me?",
    "Is there a restocking fee for returns?",
    "Can I combine two orders to get free shipping?",
    "What should I do if my stove leaks gas?",
    "Are your boots suitable for winter hiking in snow?",
    "Do you price match Amazon?",
    "I'd like to speak to a person, please.",
    "Can I change the colour of the jacket I ordered yesterday?",
    "Thanks for your help! Have a nice day.",
)

GENERAL_QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are there in a leap year?",
    "What is the boiling point of water at sea level in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "How many continents are there?",
    "What is photosynthesis, in one sentence?",
    "Name three primary colours.",
    "What is the chemical symbol for gold?",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "What is the square root of 81?",
    "Translate 'good morning' into Spanish.",
    "What is the opposite of 'ancient'?",
    "Give me a synonym for 'happy'.",
    "What language is spoken in Brazil?",
    "What is the tallest mountain in the world?",
    "Which ocean is the largest?",
    "How many minutes are in three hours?",
    "What does a thermometer measure?",
    "Why is the sky blue?",
    "What causes the seasons on Earth?",
    "What is the main ingredient of guacamole?",
    "How do I boil an egg?",
    "Give me a tip for falling asleep faster.",
    "What is a good way to start learning to cook?",
    "Suggest a name for a pet goldfish.",
    "Write a haiku about autumn.",
    "Write one sentence about the sea.",
    "Tell me a short joke about computers.",
    "Summarise the story of Cinderella in two sentences.",
    "What is the difference between weather and climate?",
    "Explain what a computer program is to a child.",
    "What is the freezing point of water in Fahrenheit?",
    "How many sides does a hexagon have?",
    "Who painted the Mona Lisa?",
    "What is the currency of the United Kingdom?",
    "What is the fastest land animal?",
    "What do bees make?",
    "What is the plural of 'mouse'?",
    "Is a tomato a fruit or a vegetable?",
    "How can I save water at home?",
    "What are three benefits of regular exercise?",
    "Give me three ideas for a rainy afternoon.",
    "What is a noun? Give an example.",
    "What is the longest river in Africa?",
    "How many hours are in a week?",
    "What gas do plants absorb from the air?",
    "What is the capital of Canada?",
    "Write a short thank-you note to a teacher.",
    "What should I pack for a day hike?",
    "Explain what gravity is in simple words.",
    "What is the difference between a lake and a sea?",
    "Why do we have day and night?",
    "List the days of the week.",
    "What is 15 plus 27?",
    "How do you say 'thank you' in French?",
    "What is the smallest prime number?",
    "Recommend a classic novel and say why in one sentence.",
)


def support_chat(question: str) -> list[dict[str, str]]:
    """A customer's question under the shop's system prompt (the demo's and the accuracy set's)."""
    return [{"role": "system", "content": SUPPORT_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def general_chat(question: str) -> list[dict[str, str]]:
    """A question with no system prompt (SmolLM2's chat template then adds its own default)."""
    return [{"role": "user", "content": question}]


def accuracy_chats() -> list[list[dict[str, str]]]:
    """The fixed set of 120 chats whose greedy answers the accuracy benchmark compares."""
    return [support_chat(q) for q in SUPPORT_QUESTIONS] + [general_chat(q) for q in GENERAL_QUESTIONS]
