"""Word tables the synthetic catalog is drawn from.

Five WebShop categories, six product types each. A product type fixes the title noun, the
search query it was "scraped" under, the category path, an attribute pool (the phrases goals
ask for) and its option pools. Option pools are chosen so that two different values of one
pool never match under the reward's fuzzy option matcher (tests/envs/test_shop_reward.py checks
it): a wrong click must score as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProductType:
    noun: str  # title head, e.g. "shampoo"
    query: str  # WebShop's scrape query for the type
    path: str  # product_category, parts joined by " › "
    attributes: tuple[str, ...]  # attribute pool (>= 8 phrases)
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (option name, value pool) pairs
    price: tuple[float, float]  # price range of the type, dollars


SIZES = ("small", "medium", "large", "xl", "xxl", "3xl")
SHOE_SIZES = ("6", "7", "8", "9", "10", "11", "12")
COLORS = (
    "black",
    "white",
    "grey",
    "navy",
    "red",
    "blue",
    "green",
    "pink",
    "beige",
    "brown",
    "purple",
    "yellow",
    "orange",
    "teal",
    "ivory",
    "olive",
    "khaki",
    "burgundy",
)
METALS = ("silver", "gold", "copper", "bronze")
PACKS = ("single", "twin pack", "4 count", "value bundle")
BOTTLE_SIZES = ("8 fl oz", "16 fl oz", "32 fl oz")


def _t(noun, query, path, attributes, options, price) -> ProductType:
    return ProductType(noun, query, path, tuple(attributes.split(", ")), tuple(options), price)


BEAUTY = "Beauty & Personal Care"
ELECTRONICS = "Electronics"
FASHION = "Clothing, Shoes & Jewelry"
GARDEN = "Home & Kitchen"
GROCERY = "Grocery & Gourmet Food"

CATEGORIES: dict[str, tuple[ProductType, ...]] = {
    "beauty": (
        _t(
            "shampoo",
            "shampoo",
            f"{BEAUTY} › Hair Care › Shampoo",
            "sulfate free, paraben free, for dry hair, color safe, argan oil, tea tree, "
            "cruelty free, vegan, volumizing, anti dandruff",
            [("size", BOTTLE_SIZES), ("scent", ("coconut", "lavender", "eucalyptus", "unscented"))],
            (6, 40),
        ),
        _t(
            "face moisturizer",
            "face moisturizer",
            f"{BEAUTY} › Skin Care › Face › Moisturizers",
            "hyaluronic acid, fragrance free, for sensitive skin, oil free, spf 30, non comedogenic, "
            "anti aging, vitamin c, dermatologist tested",
            [("size", ("1.7 oz", "2.5 oz", "3.4 oz"))],
            (9, 65),
        ),
        _t(
            "lipstick",
            "lipstick",
            f"{BEAUTY} › Makeup › Lips › Lipstick",
            "long lasting, matte finish, cruelty free, moisturizing, waterproof, vegan, "
            "transfer proof, highly pigmented",
            [("color", ("red", "pink", "burgundy", "brown", "purple", "orange"))],
            (5, 30),
        ),
        _t(
            "hair dryer",
            "hair dryer",
            f"{BEAUTY} › Hair Care › Styling Tools › Hair Dryers",
            "ionic, fast drying, lightweight, low noise, ceramic, with diffuser, travel size, foldable handle",
            [("color", ("black", "white", "pink", "teal"))],
            (18, 120),
        ),
        _t(
            "nail polish",
            "nail polish",
            f"{BEAUTY} › Foot, Hand & Nail Care › Nail Polish",
            "quick dry, long lasting, non toxic, gel effect, chip resistant, vegan, glossy finish, cruelty free",
            [("color", ("red", "pink", "navy", "beige", "teal", "burgundy", "ivory")), ("pack", PACKS)],
            (4, 25),
        ),
        _t(
            "body lotion",
            "body lotion",
            f"{BEAUTY} › Skin Care › Body › Lotions",
            "shea butter, for dry skin, fast absorbing, non greasy, fragrance free, "
            "natural ingredients, paraben free, aloe vera",
            [("size", BOTTLE_SIZES), ("scent", ("vanilla", "lavender", "cucumber", "unscented"))],
            (5, 35),
        ),
    ),
    "electronics": (
        _t(
            "wireless earbuds",
            "wireless earbuds",
            f"{ELECTRONICS} › Headphones › Earbud Headphones",
            "noise cancelling, bluetooth 5.3, waterproof, long battery life, with charging case, "
            "built in microphone, touch control, fast charging",
            [("color", ("black", "white", "navy", "green"))],
            (19, 180),
        ),
        _t(
            "phone case",
            "phone case",
            f"{ELECTRONICS} › Cell Phones & Accessories › Cases",
            "shockproof, slim fit, wireless charging compatible, clear back, with kickstand, "
            "scratch resistant, raised edges, drop protection",
            [
                ("color", ("black", "blue", "red", "purple", "green", "pink")),
                ("model", ("iphone 14", "iphone 15 pro", "galaxy s23", "pixel 8")),
            ],
            (8, 35),
        ),
        _t(
            "portable charger",
            "portable charger",
            f"{ELECTRONICS} › Portable Power Banks",
            "fast charging, usb c, high capacity, compact, led display, dual output, "
            "airline approved, pass through charging",
            [("capacity", ("5000mah", "10000mah", "26800mah")), ("color", ("black", "white", "blue"))],
            (15, 70),
        ),
        _t(
            "smart watch",
            "smart watch",
            f"{ELECTRONICS} › Wearable Technology › Smartwatches",
            "heart rate monitor, sleep tracking, waterproof, gps, long battery life, "
            "blood oxygen, amoled display, bluetooth calling",
            [("color", ("black", "silver", "pink", "green")), ("band size", ("38mm", "42mm", "46mm"))],
            (30, 260),
        ),
        _t(
            "hdmi cable",
            "hdmi cable",
            f"{ELECTRONICS} › Accessories & Supplies › Cables",
            "4k, high speed, braided, gold plated, 8k ready, ethernet, ultra durable, 120hz",
            [("length", ("3 feet", "6 feet", "25 feet"))],
            (6, 30),
        ),
        _t(
            "bluetooth speaker",
            "bluetooth speaker",
            f"{ELECTRONICS} › Portable Audio & Video › Speakers",
            "waterproof, loud stereo sound, deep bass, long battery life, portable, "
            "built in microphone, outdoor, shockproof",
            [("color", ("black", "blue", "red", "grey", "teal"))],
            (20, 150),
        ),
    ),
    "fashion": (
        _t(
            "running shoes",
            "running shoes",
            f"{FASHION} › Men › Shoes › Athletic",
            "lightweight, breathable, non slip, memory foam, arch support, rubber sole, machine washable, wide toe box",
            [("size", SHOE_SIZES), ("color", ("black", "white", "grey", "navy", "blue", "red"))],
            (25, 140),
        ),
        _t(
            "t-shirt",
            "t-shirt",
            f"{FASHION} › Women › Clothing › Tops & Tees",
            "cotton, short sleeve, crew neck, relaxed fit, moisture wicking, machine washable, soft fabric, tagless",
            [("size", SIZES), ("color", COLORS[:10])],
            (8, 35),
        ),
        _t(
            "yoga pants",
            "yoga pants",
            f"{FASHION} › Women › Clothing › Active › Leggings",
            "high waist, tummy control, squat proof, with pockets, four way stretch, "
            "moisture wicking, buttery soft, ankle length",
            [("size", SIZES[:5]), ("color", ("black", "navy", "grey", "olive", "burgundy", "purple"))],
            (15, 55),
        ),
        _t(
            "winter jacket",
            "winter jacket",
            f"{FASHION} › Men › Clothing › Jackets & Coats",
            "water resistant, hooded, fleece lined, windproof, insulated, zip pockets, packable, warm",
            [("size", SIZES), ("color", ("black", "navy", "olive", "khaki", "red"))],
            (40, 220),
        ),
        _t(
            "sun hat",
            "sun hat",
            f"{FASHION} › Women › Accessories › Hats & Caps",
            "wide brim, upf 50, packable, adjustable strap, breathable, straw, foldable, chin strap",
            [("color", ("beige", "khaki", "black", "white", "pink"))],
            (10, 40),
        ),
        _t(
            "necklace",
            "necklace",
            f"{FASHION} › Women › Jewelry › Necklaces",
            "sterling silver, hypoallergenic, gift box, dainty, adjustable chain, "
            "nickel free, tarnish resistant, handmade",
            [("metal", METALS), ("length", ("choker", "princess", "matinee"))],
            (12, 90),
        ),
    ),
    "garden": (
        _t(
            "throw pillow cover",
            "throw pillow cover",
            f"{GARDEN} › Home Décor › Throw Pillow Covers",
            "soft velvet, hidden zipper, machine washable, decorative, farmhouse, double sided, square, fade resistant",
            [("size", ("18x18 inch", "20x20 inch", "26x26 inch")), ("color", COLORS[8:16])],
            (8, 30),
        ),
        _t(
            "office chair",
            "office chair",
            f"{GARDEN} › Furniture › Home Office Furniture › Chairs",
            "ergonomic, lumbar support, adjustable height, mesh back, swivel, with armrests, high back, easy assembly",
            [("color", ("black", "grey", "white", "blue"))],
            (60, 320),
        ),
        _t(
            "bed sheet set",
            "bed sheet set",
            f"{GARDEN} › Bedding › Sheets & Pillowcases",
            "deep pocket, microfiber, wrinkle free, breathable, cooling, hypoallergenic, "
            "egyptian cotton, fade resistant",
            [("size", ("twin", "full", "queen", "king")), ("color", ("white", "grey", "navy", "beige", "teal"))],
            (20, 110),
        ),
        _t(
            "led desk lamp",
            "led desk lamp",
            f"{GARDEN} › Lighting › Lamps › Desk Lamps",
            "dimmable, eye caring, usb charging port, touch control, adjustable arm, "
            "energy saving, memory function, flicker free",
            [("color", ("black", "white", "silver"))],
            (15, 70),
        ),
        _t(
            "storage bins",
            "storage bins",
            f"{GARDEN} › Storage & Organization › Baskets & Bins",
            "collapsible, with lids, stackable, fabric, with handles, durable, closet organizer, washable",
            [("pack", PACKS), ("color", ("grey", "beige", "white", "navy"))],
            (12, 45),
        ),
        _t(
            "garden hose",
            "garden hose",
            f"{GARDEN} › Patio, Lawn & Garden › Watering Equipment",
            "expandable, kink free, lightweight, leak proof, with spray nozzle, heavy duty, brass fittings, flexible",
            [("length", ("25 ft", "50 ft", "100 ft"))],
            (18, 80),
        ),
    ),
    "grocery": (
        _t(
            "coffee beans",
            "coffee beans",
            f"{GROCERY} › Beverages › Coffee › Whole Bean",
            "organic, fair trade, dark roast, single origin, low acid, arabica, kosher, freshly roasted",
            [("size", ("12 ounce", "2 pound", "bulk bag")), ("flavor", ("hazelnut", "mocha", "original", "decaf"))],
            (8, 55),
        ),
        _t(
            "protein bars",
            "protein bars",
            f"{GROCERY} › Snacks › Nutrition Bars",
            "gluten free, high protein, low sugar, keto friendly, non gmo, plant based, "
            "no artificial sweeteners, dairy free",
            [("flavor", ("chocolate", "peanut butter", "cookie dough", "berry")), ("pack", ("12 bars", "30 bars"))],
            (12, 60),
        ),
        _t(
            "green tea",
            "green tea",
            f"{GROCERY} › Beverages › Tea › Green Tea",
            "organic, caffeine free, antioxidant rich, individually wrapped, non gmo, unsweetened, loose leaf, kosher",
            [("flavor", ("jasmine", "matcha", "lemon", "original")), ("pack", ("20 bags", "100 bags"))],
            (5, 30),
        ),
        _t(
            "olive oil",
            "olive oil",
            f"{GROCERY} › Pantry Staples › Cooking Oils",
            "extra virgin, cold pressed, organic, first cold press, non gmo, kosher, single origin, glass bottle",
            [("size", ("16.9 fl oz", "1 liter", "gallon"))],
            (9, 60),
        ),
        _t(
            "gummy vitamins",
            "gummy vitamins",
            f"{GROCERY} › Health › Vitamins & Supplements",
            "sugar free, vegan, gluten free, non gmo, for kids, natural flavors, gelatin free, immune support",
            [("flavor", ("strawberry", "orange", "mixed fruit", "lemon")), ("pack", ("60 count", "120 count"))],
            (8, 40),
        ),
        _t(
            "trail mix",
            "trail mix",
            f"{GROCERY} › Snacks › Nuts & Trail Mix",
            "gluten free, no added sugar, high protein, resealable bag, non gmo, roasted, unsalted, vegan",
            [("size", ("8 ounce", "1.5 pound", "3 pound"))],
            (6, 35),
        ),
    ),
}

SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ra",
    "ve",
    "no",
    "zu",
    "ta",
    "be",
    "lu",
    "sa",
    "qui",
    "dor",
    "fen",
    "gal",
    "hy",
    "ix",
    "jo",
    "mar",
    "pel",
    "ros",
    "tin",
    "vor",
    "wyn",
    "xan",
    "yel",
    "zo",
    "cor",
    "bri",
    "lin",
)

OPENERS = ("i need", "i am looking for", "find me", "i want", "i would like", "i'm looking for")

BULLET_TEMPLATES = (
    "{attr} design that makes this {noun} a reliable everyday choice",
    "crafted to be {attr}, so the {noun} keeps working the way you expect",
    "{attr} and thoroughly tested before it leaves our facility",
    "customers choose this {noun} because it is {attr}",
)

DESCRIPTION_TEMPLATES = (
    "The {brand} {line} {noun} is {a0}. It is made for people who want a {noun} they can count on.",
    "Meet the {line} {noun} from {brand}: {a0} and {a1}. Every unit is checked before shipping.",
    "{brand} built the {line} {noun} to be {a0}. Order today and see the difference.",
)

REVIEWS = (
    "Works exactly as described, very happy with it.",
    "Good value for the price.",
    "Arrived quickly and well packaged.",
    "Quality is better than I expected.",
    "Decent, but the packaging could be better.",
    "I would buy this again.",
)
