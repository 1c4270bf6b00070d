def main() -> None:
    print("belayer")
