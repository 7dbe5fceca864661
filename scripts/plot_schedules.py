"""Draw every learning-rate schedule into docs/images/schedules.png."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.train.recipe.schedules import plot_schedules  # noqa: E402

if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "images" / "schedules.png"
    plot_schedules(target)
    print(f"wrote {target}")
